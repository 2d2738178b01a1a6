"""A trainer extension reporting gradient communication through Chainer.

:class:`CommunicationReport` reads the multi-node optimizer's
``communication_stats()`` after every iteration and reports what changed
since the previous iteration through :func:`chainer.report`, so that
``LogReport`` logs it, ``PrintReport`` prints it and ``PlotReport`` plots it
next to the loss.  It is re-exported by :mod:`chainermn_overlap.extensions`.
"""
from typing import Any, Dict, List, Optional

import chainer
from chainer.training import extension as extension_module

__all__ = ['CommunicationReport']

# communication_stats() counters reported as differences per interval; the
# hidden fraction is recomputed from the differences.
_COUNTERS = ('buckets', 'bytes', 'comm_seconds', 'wait_seconds')


class CommunicationReport(extension_module.Extension):
    """Reports the optimizer's communication counters every iteration.

    Each call reports, for the iterations since the previous call, the
    keys of ``communication_stats()`` with ``prefix`` in front:
    ``comm/bytes`` (bytes reduced), ``comm/buckets``, ``comm/comm_seconds``
    (time the communication engine spent reducing), ``comm/wait_seconds``
    (time training waited for reductions), ``comm/hidden_fraction``
    (``1 - wait/comm`` of that interval; left out of an interval without
    any reduction) and, with a compression, ``comm/compression_seconds``.
    ``LogReport`` averages them over its own interval.

    The figures are this rank's; nothing is communicated, so the extension
    may be added on rank 0 only, as ``LogReport`` usually is.  With
    ``wait='forward'`` a reduction is waited for in the next iteration's
    forward, so waits are counted in the iteration that waited.  The
    counters are read, never reset: ``communication_stats(reset=True)``
    elsewhere is noticed and counted from the reset.

    Usage::

        report = chainermn_overlap.extensions.CommunicationReport()
        trainer.extend(report)
        trainer.extend(extensions.LogReport())
        trainer.extend(extensions.PrintReport(
            ['iteration', 'main/loss'] + report.entries))
        trainer.extend(extensions.PlotReport(
            ['comm/wait_seconds', 'comm/comm_seconds'], 'iteration',
            filename='comm.png'))

    Args:
        optimizer: The optimizer to read, or the name of one of the
            trainer's updater's optimizers (default ``'main'``).  It must
            have ``communication_stats()``: one made by
            :func:`chainermn_overlap.create_overlapped_optimizer` or
            :func:`chainermn_overlap.create_double_buffering_optimizer`.
        prefix (str): Put in front of every reported key.
    """

    trigger = 1, 'iteration'
    # Before LogReport and PrintReport (readers) of the same iteration.
    priority = extension_module.PRIORITY_WRITER
    name = 'CommunicationReport'

    def __init__(self, optimizer: Any = 'main', prefix: str = 'comm/'):
        if not isinstance(prefix, str):
            raise ValueError('prefix must be a string such as "comm/"; got '
                             '{!r}.'.format(prefix))
        if not isinstance(optimizer, str):
            self._check(optimizer, repr(type(optimizer).__name__))
        self._optimizer = optimizer
        self._prefix = prefix
        self._last: Optional[Dict[str, Any]] = None

    @property
    def entries(self) -> List[str]:
        """The keys reported (for ``PrintReport``), compression left out."""
        return [self._prefix + k for k in
                ('bytes', 'comm_seconds', 'wait_seconds', 'hidden_fraction')]

    @staticmethod
    def _check(optimizer, what):
        if not callable(getattr(optimizer, 'communication_stats', None)):
            raise ValueError(
                'CommunicationReport needs an optimizer with '
                'communication_stats(), made by '
                'chainermn_overlap.create_overlapped_optimizer or '
                'create_double_buffering_optimizer; {} has none (ChainerMN\'s '
                'create_multi_node_optimizer keeps no such counters).'
                .format(what))

    def _resolve(self, trainer):
        if not isinstance(self._optimizer, str):
            return self._optimizer
        name = self._optimizer
        try:
            optimizer = trainer.updater.get_optimizer(name)
        except KeyError:
            raise ValueError(
                'CommunicationReport: the updater has no optimizer named '
                '{!r}; pass the name it was given (the updater\'s optimizers: '
                '{}) or the optimizer itself.'.format(
                    name, sorted(trainer.updater.get_all_optimizers())))
        self._check(optimizer, 'the updater\'s optimizer {!r} ({})'.format(
            name, type(optimizer).__name__))
        return optimizer

    def initialize(self, trainer):
        self._optimizer = self._resolve(trainer)
        self._last = dict(self._optimizer.communication_stats())

    def __call__(self, trainer):
        if self._last is None:  # called without initialize (tests, manual)
            self.initialize(trainer)
            return
        now = dict(self._optimizer.communication_stats())
        chainer.report(self.difference(self._last, now, self._prefix))
        self._last = now

    @staticmethod
    def difference(before: Dict[str, Any], now: Dict[str, Any],
                   prefix: str = 'comm/') -> Dict[str, float]:
        """The observation for the interval between two readings.

        Args:
            before (dict): ``communication_stats()`` at the interval's start.
            now (dict): ``communication_stats()`` at its end.
            prefix (str): Put in front of every key.

        Returns:
            dict: Differences of the counters, the interval's hidden
            fraction where it reduced anything, and the compression time
            where there is one.  If a counter went down (the counters were
            reset in between), ``now`` is the interval.
        """
        keys = _COUNTERS + (('compression_seconds',)
                            if 'compression_seconds' in now else ())
        reset = any(now.get(k, 0) < before.get(k, 0) for k in keys)
        out = {}
        for k in keys:
            out[k] = now.get(k, 0) - (0 if reset else before.get(k, 0))
        if out['comm_seconds'] > 0:
            out['hidden_fraction'] = (1.0 - out['wait_seconds']
                                      / out['comm_seconds'])
        return {prefix + k: v for k, v in out.items()}
