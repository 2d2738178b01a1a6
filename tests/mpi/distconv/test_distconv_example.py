"""Smoke test: examples/spatial/train_spatial.py runs at any process count."""
import importlib.util
import os
import sys

from distconv_mpi_helpers import comm

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, '..', '..', '..', 'examples', 'spatial',
                       'train_spatial.py')


def test_train_spatial_example_runs(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location('train_spatial', EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, 'argv', ['train_spatial.py', '--iterations',
                                      '2', '--insize', '32',
                                      '--batchsize', '4'])
    module.main()
    out = capsys.readouterr().out
    if comm().rank == 0:
        assert 'iteration   2' in out
