"""The method the studies share: how a measurement is run and reported.

Statistics and rounds:

* :mod:`~benchmarks.harness.stats`: per-round ratios, medians and their
  bootstrap intervals, paired differences;
* :mod:`~benchmarks.harness.turns`: several live jobs taking turns round
  by round (the idle job's ranks blocked in a read);
* :mod:`~benchmarks.harness.interleave`: trainer jobs on one bed,
  interleaved through :mod:`.turns`;
* :mod:`~benchmarks.harness.ab`: two revisions of the library on one bed
  (also a study: ``python -m benchmarks ab``).

Jobs and workers:

* :mod:`~benchmarks.harness.launch`: worker command lines, their
  environment (one BLAS thread), the ``--worker`` dispatch and the tagged
  result line;
* :mod:`~benchmarks.harness.bedrun`: optimizer jobs on the test bed,
  their timing summaries and the link's calibration;
* :mod:`~benchmarks.harness.trainer`: the optimizer studies' worker (one
  model and optimizer per mode, warmed once, timed in rounds);
* :mod:`~benchmarks.harness.workloads`: the ImageNet example's networks
  and synthetic batches; :mod:`~benchmarks.harness.anchor`: the anchor
  configuration replayed;
* :mod:`~benchmarks.harness.distconv_jobs`: the distconv studies' jobs,
  memory per step and link counters;
* :mod:`~benchmarks.harness.peers_torch` and
  :mod:`~benchmarks.harness.torch_models`: the PyTorch DDP peer and its
  twins of the Chainer models.

Results:

* :mod:`~benchmarks.harness.machine`: the machine description every
  results file carries;
* :mod:`~benchmarks.harness.registry`: the studies ``python -m
  benchmarks`` lists and runs.

No module here imports a study.
"""
