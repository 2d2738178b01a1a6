"""Data-parallel ImageNet training: ``train_imagenet`` and its ``models``."""
