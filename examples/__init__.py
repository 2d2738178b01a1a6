"""Examples, importable from the repository root (``examples.imagenet``).

Each script also runs as a file, e.g.
``mpiexec -n 2 python examples/imagenet/train_imagenet.py``.
"""
