"""The network test bed: MPI ranks and whole hosts in Linux namespaces.

Infrastructure shared by the tests (``tests/netbed``) and the benchmarks;
it is not part of the library and needs root:

* :mod:`testbed.netbed`: one rank per network namespace behind tc-shaped
  links (:class:`~testbed.netbed.NetBed`), started by one local
  ``mpiexec``;
* :mod:`testbed.hosts`: simulated hosts, each a namespace with its own
  ``sshd`` and IPC/UTS namespaces, a login namespace, a hostfile and a
  shared snapshot folder (:class:`~testbed.hosts.HostBed`), for jobs
  started over ssh as on a cluster; :mod:`testbed.faults` breaks them,
  :mod:`testbed.jobs` runs and watches a launcher job on them;
* :mod:`testbed.netrelay`: a link delay without ``netem``;
* :mod:`testbed.probe`: the allreduce bandwidth probe;
* :mod:`testbed.cli`: ``python -m testbed.netbed`` (or ``python -m
  testbed``).

See ``testbed/README.md``.
"""
