"""The sharding options of ``create_overlapped_optimizer``, checked.

Given either as one :class:`ShardOptions` (``shard=ShardOptions(
'parameters', prefetch='64MB')``) or as a mode string with the ``shard_*``
keywords (``shard='parameters', shard_prefetch='64MB'``), not both;
:func:`resolve` turns either into the :class:`ShardSettings` the
optimizer's parts read.
"""
import collections
from typing import Any, Optional, Union

from chainermn_overlap import config

__all__ = ['AUTO_IN_FLIGHT_FRACTION', 'DEFAULTS', 'SHARD_MODES',
           'ShardOptions', 'ShardSettings', 'check', 'in_flight_limit',
           'prefetch_budget', 'resolve']

SHARD_MODES = (None, 'optimizer', 'gradients', 'parameters')


class _Default(object):
    """A ``shard_*`` keyword left at its default: shows as the value (in
    signatures and docs) and tells "not given" from "given the default"."""

    __slots__ = ('value',)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return repr(self.value)


#: The ``shard_*`` keywords' defaults (``create_overlapped_optimizer``'s
#: signature), by :class:`ShardOptions` field.
DEFAULTS = {'unit': _Default('auto'), 'update': _Default('update'),
            'in_flight': _Default('auto'), 'prefetch': _Default('auto')}


class ShardOptions(object):
    """Every sharding option of the overlapped optimizer, in one object.

    ``create_overlapped_optimizer(actual, comm, shard=ShardOptions(
    'parameters', prefetch='64MB'))`` is ``create_overlapped_optimizer(
    actual, comm, shard='parameters', shard_prefetch='64MB')``; see
    :func:`~chainermn_overlap.create_overlapped_optimizer` for what each
    option does.  A bad value or combination raises ``ValueError`` here.

    Args:
        mode (str): ``'optimizer'``, ``'gradients'`` or ``'parameters'``
            (``shard=``).
        unit (str): how buckets are cut between ranks (``shard_unit=``):
            ``'auto'``, ``'element'`` or ``'parameter'``.
        update (str): when a shard is updated and gathered
            (``shard_update=``): ``'update'`` or ``'backward'``.
        in_flight (int or str): bound on the full gradient buckets waiting
            for their reduce-scatter (``shard_in_flight=``): bytes,
            ``'auto'`` or None.
        prefetch (int or str): bytes of whole parameters fetched ahead
            (``shard_prefetch=``), ``'auto'`` or None.
    """

    __slots__ = ('mode', 'unit', 'update', 'in_flight', 'prefetch')

    def __init__(self, mode: str, unit: str = 'auto', update: str = 'update',
                 in_flight: Union[None, int, str] = 'auto',
                 prefetch: Union[None, int, str] = 'auto') -> None:
        if mode is None:
            raise ValueError(
                "ShardOptions needs a mode: 'optimizer', 'gradients' or "
                "'parameters' (for no sharding give shard=None)")
        _checked(mode, unit, update, in_flight, prefetch, None, None)
        self.mode = mode
        self.unit = unit
        self.update = update
        self.in_flight = in_flight
        self.prefetch = prefetch

    def __repr__(self):
        return 'ShardOptions({})'.format(', '.join(
            '{}={!r}'.format(n, getattr(self, n)) for n in self.__slots__))

    def __eq__(self, other):
        return (isinstance(other, ShardOptions) and all(
            getattr(self, n) == getattr(other, n) for n in self.__slots__))

    def __hash__(self):
        return hash(tuple(getattr(self, n) for n in self.__slots__))


# What the optimizer's wiring reads: the mode (None: no sharding), how
# buckets are cut, when a shard is updated, the bound on gradients waiting
# for their reduce-scatter (in_flight_limit) and the prefetch budget of
# shard='parameters' (prefetch_budget).
ShardSettings = collections.namedtuple(
    'ShardSettings', ['mode', 'unit', 'update', 'in_flight', 'prefetch'])


def resolve(shard: Union[None, str, ShardOptions], shard_unit: Any,
            shard_update: Any, shard_in_flight: Any, shard_prefetch: Any,
            compression: Any, backend: Optional[str]) -> ShardSettings:
    """Checks ``create_overlapped_optimizer``'s sharding arguments; returns
    their :class:`ShardSettings`.

    ``shard`` is a mode (or None) with the ``shard_*`` keywords, each one
    left at its default (:data:`DEFAULTS`) or given; or a
    :class:`ShardOptions`, with none of them given.
    """
    given = {'shard_unit': shard_unit, 'shard_update': shard_update,
             'shard_in_flight': shard_in_flight,
             'shard_prefetch': shard_prefetch}
    given = {k: v for k, v in given.items() if not isinstance(v, _Default)}
    if isinstance(shard, ShardOptions):
        if given:
            raise ValueError(
                'shard={!r} and {} were both given: the ShardOptions holds '
                'every sharding option; give it {} (or a mode string with '
                'the shard_* keywords instead)'.format(
                    shard, ', '.join('{}={!r}'.format(k, v)
                                     for k, v in sorted(given.items())),
                    ', '.join('{}=...'.format(k[len('shard_'):])
                              for k in sorted(given))))
        opts = shard
        args = (opts.mode, opts.unit, opts.update, opts.in_flight,
                opts.prefetch)
    else:
        args = (shard,) + tuple(
            v.value if isinstance(v, _Default) else v
            for v in (shard_unit, shard_update, shard_in_flight,
                      shard_prefetch))
    return _checked(*args, compression, backend)


def _checked(shard, shard_unit, shard_update, shard_in_flight,
             shard_prefetch, compression, backend):
    check(shard, shard_unit, shard_update, compression, backend)
    return ShardSettings(shard, shard_unit, shard_update,
                         in_flight_limit(shard, shard_in_flight),
                         prefetch_budget(shard, shard_prefetch))


def check(shard, shard_unit, shard_update, compression, backend):
    """Raises ``ValueError`` naming a bad sharding argument and the fix."""
    if shard_update not in ('backward', 'update'):
        raise ValueError("shard_update must be 'backward' or 'update', got "
                         '{!r}'.format(shard_update))
    if shard not in SHARD_MODES:
        raise ValueError(
            "shard must be None, 'optimizer', 'gradients' or 'parameters', "
            'got {!r}'.format(shard))
    if shard_unit not in ('auto', 'element', 'parameter'):
        raise ValueError("shard_unit must be 'auto', 'element' or "
                         "'parameter', got {!r}".format(shard_unit))
    if shard is None:
        return
    if compression is not None:
        raise ValueError(
            'shard={!r} cannot be combined with compression: PowerSGD '
            'reduces low-rank factors of whole gradients, which no rank '
            'holds when they are sharded; drop one of the two.'.format(shard))
    if backend == 'nccl':
        raise ValueError(
            "shard={!r} runs on the MPI engines ('mpi_priority', "
            "'mpi_thread'; GPU arrays are staged through host memory), not "
            "on backend='nccl'.".format(shard))


# shard_in_flight='auto': the part of the parameters' bytes that gradients
# still waiting for their reduce-scatter may hold when update() returns.
# An eighth keeps stages 2 and 3 within 0.5 bytes per parameter (float32)
# of their ideal between steps, well inside the 0.07 of ChainerMN's 16 that
# they promise, at any rank count.
AUTO_IN_FLIGHT_FRACTION = 8


def in_flight_limit(shard, shard_in_flight):
    """How much of the full gradient buckets waiting for their
    reduce-scatter a rank may hold: ``(n, 'bytes')`` or ``(n, 'buckets')``
    (before backward fills another bucket, and when ``update()``
    returns), ``'auto'`` or None (no bound).

    ``'auto'`` (stages 2 and 3): no bound during backward, which then never
    waits for the link (on the test bed a bound of two buckets cost stage
    2 0.08 of scalability on ResNet-50, and stage 3 0.10-0.12 even at
    32-48 MiB); but ``update()`` returns only once what still waits is
    below :data:`AUTO_IN_FLIGHT_FRACTION`'s part of the parameters' bytes,
    so that the bytes a rank holds between steps keep the stage's promise
    (with ``wait='forward'`` the whole gradient could otherwise still be in
    flight then: as much as stage 1 holds).  None: no bound at all.
    """
    if shard_in_flight == 'auto':
        return 'auto' if shard in ('gradients', 'parameters') else None
    if shard_in_flight is None:
        return None
    if shard not in ('gradients', 'parameters'):
        raise ValueError(
            'shard_in_flight={!r} bounds the gradients waiting for their '
            "reduce-scatter, which only shard='gradients' and 'parameters' "
            'release (shard={!r} keeps them whole): drop shard_in_flight or '
            'choose one of those.'.format(shard_in_flight, shard))
    try:
        return config.parse_size(shard_in_flight), 'bytes'
    except ValueError as e:
        raise ValueError('shard_in_flight: {} (or None for no bound, '
                         "'auto' for the default)".format(e)) from None


def prefetch_budget(shard, shard_prefetch):
    """The bytes of whole parameters ``shard='parameters'`` holds besides
    the bucket in use: a number, ``'auto'`` (resolved at the layout: one
    rank's share of the parameters, at least two buckets) or None (no
    bound: every bucket of the iteration's next uses)."""
    if shard_prefetch == 'auto':
        return 'auto'
    if shard != 'parameters':
        raise ValueError(
            'shard_prefetch={!r} bounds the whole parameters fetched ahead, '
            "which only shard='parameters' releases (shard={!r} keeps them "
            "whole): drop shard_prefetch or use shard='parameters'."
            .format(shard_prefetch, shard))
    if shard_prefetch is None:
        return None
    if shard_prefetch == 0 and not isinstance(shard_prefetch, bool):
        return 0   # only the next bucket ahead
    try:
        return config.parse_size(shard_prefetch)
    except ValueError as e:
        raise ValueError('shard_prefetch: {} (or None for no bound, '
                         "'auto' for the default)".format(e)) from None
