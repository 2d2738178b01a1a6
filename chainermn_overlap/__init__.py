"""Overlapped gradient reduction and spatial parallelism for Chainer/ChainerMN."""
