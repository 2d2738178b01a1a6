"""Spatially partitioned training examples (each script self-contained)."""
