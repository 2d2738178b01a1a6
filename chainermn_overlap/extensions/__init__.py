"""Trainer extensions for long runs.

:func:`auto_snapshot` (in :mod:`chainermn_overlap.extensions.snapshot`)
writes atomic, checksummed snapshots on every rank and resumes from the
newest intact one when the trainer starts, on the same or a different
number of ranks; it is what ``python -m chainermn_overlap.launch`` restarts
from.  The file-system part (durable writes, manifests, housekeeping) is
:mod:`chainermn_overlap.extensions._store`.  :class:`CommunicationReport`
reports the optimizer's communication counters through Chainer's reporter.
"""
from chainermn_overlap.extensions.snapshot import AutoSnapshot  # NOQA
from chainermn_overlap.extensions.snapshot import auto_snapshot  # NOQA
from chainermn_overlap.extensions.snapshot import SnapshotWarning  # NOQA
from chainermn_overlap._comm_report import CommunicationReport  # NOQA

__all__ = ['AutoSnapshot', 'CommunicationReport', 'SnapshotWarning',
           'auto_snapshot']
