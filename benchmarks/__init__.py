"""Reproducible measurements of chainermn_overlap; results go to results/.

Run each benchmark from the repository root as a module::

    python -m benchmarks.overlap_bench --quick --model resnet_small
    python -m benchmarks.spatial_bench --np 1,2

``python benchmarks/overlap_bench.py`` works too: run as a file, a module
has Python put ``benchmarks/`` rather than the repository root on
``sys.path``, so the benchmarks that import the package start with a
two-line bootstrap that adds the root (``if not __package__``).  Workers
are started as modules with the root on ``PYTHONPATH``
(:mod:`benchmarks.launch`), whatever the current directory.

Shared parts:

* :mod:`benchmarks.launch`: worker command lines, their environment (one
  BLAS thread), the ``--worker`` dispatch and the tagged result line;
* :mod:`benchmarks.machine`: the machine description in results files;
* :mod:`benchmarks.workloads`: the ImageNet example's models and synthetic
  batches that the optimizer benchmarks time;
The network test bed they run on (namespaces, shaped links, hosts with
ssh) is the package ``testbed/`` at the repository root.
"""
