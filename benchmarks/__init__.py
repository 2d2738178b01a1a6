"""Reproducible measurements of chainermn_overlap; results go to results/.

Two kinds of module live here:

* the **studies**, one module per measurement at this level (its
  docstring says the workload, the modes compared and what is reported;
  it writes ``results/<name>.json`` with the machine and configuration);
* the **method** they share, the package :mod:`benchmarks.harness`:
  rounds and bootstrap intervals, jobs that take turns, bed runs, the
  trainer worker, machine facts, worker launch and result lines.

One entry point lists and runs every study, from the repository root::

    python -m benchmarks --list
    python -m benchmarks overlap --quick --model resnet_small
    python -m benchmarks spatial --np 1,2

(each study keeps its own options, ``python -m benchmarks NAME --help``;
most take ``--rounds``, ``--rate`` for the bed's link and ``--out`` for the
results file).  ``python -m benchmarks.overlap_bench`` and ``python
benchmarks/overlap_bench.py`` work too: run as a file, a module has Python
put ``benchmarks/`` rather than the repository root on ``sys.path``, so the
studies that import the package start with a two-line bootstrap that adds
the root (``if not __package__``).  Workers are started as modules with the
root on ``PYTHONPATH`` (:mod:`benchmarks.harness.launch`), whatever the
current directory.

Adding a study: write ``benchmarks/<name>.py`` with a docstring and an
argparse ``main()`` that saves its figures with
:func:`benchmarks.harness.machine.machine_description`, add ``(name, module)`` to
:data:`benchmarks.harness.registry.STUDIES`, and a ``make bench-<name>``
target that runs ``python -m benchmarks <name>``.

The network test bed the studies run on (namespaces, shaped links, hosts
with ssh) is the package ``testbed/`` at the repository root.
"""
