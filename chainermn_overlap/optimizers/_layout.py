"""The bucket layout and the checks that keep every rank consistent.

The layout (which parameters travel in which bucket, in which order) is
built on every rank at the same point, from rank 0's plan, broadcast as
JSON: identical on all ranks by construction.  Building it also checks that
every rank has the same model, initialises what other ranks initialised
(a lazily initialised link used on some ranks only) and broadcasts every
parameter from rank 0.

Each iteration starts with a control message, the first collective of the
iteration, reduced with ``MAX``: whether this rank saw the model change
(and how), whether it loaded a snapshot, its layout fingerprint and its
iteration number.  The decision to rebuild the layout and to skip a step
is therefore global, never a per-rank guess that would make ranks disagree.
"""
import numpy

from chainermn_overlap import _host
from chainermn_overlap import _mpi_json
from chainermn_overlap.communication import blocking
from chainermn_overlap.communication import buckets as buckets_module
from chainermn_overlap.communication import watchdog as watchdog_module
from chainermn_overlap.optimizers._tracker import ParamState

# With wait='forward', limits of the last buckets (last first): they hold the
# first layers, whose reduction the next forward waits for first.
TAIL_BUCKETS = (1 << 20, 2 << 20, 4 << 20, 8 << 20)

# Levels of the control message's first slot (reduced with MAX).
UNCHANGED, RELAYOUT, SKIP = 0, 1, 2


# Parameters move as raw bytes (JSON for metadata, see _mpi_json): nothing
# received from a peer is ever unpickled.

def bcast_array(mpi_comm, array, root, timeout=None, what='a parameter'):
    """Broadcasts an array in place (as bytes; staged on the host for GPU),
    bounded by ``timeout`` (None: the environment's limit)."""
    from mpi4py import MPI
    host, finish = _host.stage_to_host(array)
    buf = numpy.ascontiguousarray(host)
    blocking.bcast(mpi_comm, [buf.view(numpy.uint8).reshape(-1), MPI.BYTE],
                   root, 'the broadcast of ' + what, timeout)
    if buf is not host:
        host[...] = buf
    if finish is not None:
        finish()


def _describe(sig):
    shape, dtype = sig
    if shape is None:
        return 'uninitialised'
    return 'shape {} {}'.format(tuple(shape), dtype)


def _local_structure(target):
    return [(n, p, None if p.array is None else p.shape,
             None if p.array is None else str(p.dtype))
            for n, p in sorted(target.namedparams())]


class LayoutManager(object):
    """Builds layouts and runs the per-iteration consistency check.

    Args:
        mpi_comm: the communicator's ``mpi_comm`` (for the blocking
            collectives of a relayout).
        bucket_size (int): fusion bucket size in bytes.
        allreduce_grad_dtype: wire dtype or None.
        wait (str): ``'forward'`` adds the small tail buckets.
    """

    def __init__(self, mpi_comm, bucket_size, allreduce_grad_dtype, wait,
                 allow_groups=True, shard_unit=None):
        self.mpi_comm = mpi_comm
        self.rank = mpi_comm.rank
        self.size = mpi_comm.size
        self.bucket_size = bucket_size
        self.allreduce_grad_dtype = allreduce_grad_dtype
        self.wait = wait
        # (name, param, shape, dtype) of every parameter at the last layout.
        self.structure = None
        self.loaded = False
        self.control = None
        self.allow_groups = allow_groups
        # 'auto', 'element' or 'parameter' when sharded: rank 0's plan then
        # also says which piece of each bucket each rank owns
        # (sharding.layout).
        self.shard_unit = shard_unit
        # (name, param, group) of the parameters reduced within a group
        # (``param.reduction_group``, e.g. distconv's channel blocks).
        self.grouped = []
        # The optimizer's watchdog options: their timeout bounds the
        # relayout's collectives (None: the environment's limit).
        self.watch_options = {}
        # The options that decide which collectives run
        # (_wrapper.collective_options), compared between ranks.
        self.options = {}

    @property
    def timeout(self):
        return self.watch_options.get('timeout')

    # ------------------------------------------------------------------
    # What changed

    def mark_loaded(self):
        """Parameters were deserialized: broadcast them at the next update.

        The step after a resume is not skipped when every rank loaded, so a
        resumed run equals an uninterrupted one.
        """
        self.loaded = True

    def changes_step(self, target):
        """Whether this rank's update must broadcast and skip the step.

        ChainerMN's rule: the set of initialised parameters (names, and
        whether each holds an array) differs from the previous update's: a
        link added or removed, a lazily initialised link that ran.  Before
        the first update there is no previous set.  Parameters loaded on
        this rank (a resume) also change the step; whether it is skipped in
        the end is decided globally (not when every rank loaded).  How the
        change came about (``setup()`` again, ``add_link``, a first forward)
        does not matter.
        """
        if self.loaded or self.structure is None:
            return True
        cur = [(n, p.array is not None)
               for n, p in sorted(target.namedparams())]
        return cur != [(n, s is not None) for n, _, s, _ in self.structure]

    def structure_changed(self, target):
        """Whether the layout must be rebuilt (any parameter replaced)."""
        if self.structure is None:
            return True
        cur = _local_structure(target)
        if len(cur) != len(self.structure):
            return True
        for (n1, p1, s1, d1), (n2, p2, s2, d2) in zip(cur, self.structure):
            if n1 != n2 or p1 is not p2 or s1 != s2 or d1 != d2:
                return True
        return False

    # ------------------------------------------------------------------
    # The control message

    def post_control(self, engine, target, buckets, iteration,
                     n_items=None):
        """First collective of every iteration: did anything change?

        ChainerMN decides locally whether the set of initialised parameters
        changed; a lazily initialised link used on one rank only would then
        make ranks disagree and hang.  Reducing the flags first makes the
        decision global, by construction the same on all ranks.
        """
        if self.control is not None:
            return
        if self.changes_step(target):
            level = SKIP
        elif self.structure_changed(target):
            level = RELAYOUT
        else:
            level = UNCHANGED
        # Also carries every rank's layout fingerprint and iteration number,
        # checked in wait_control (see watchdog.control_message).
        buf = watchdog_module.control_message(
            level, self.loaded, self.rank, self.size,
            watchdog_module.layout_fingerprint(buckets), iteration)
        self.control = (buf, engine.allreduce(
            buf, 'max',
            label='control message of iteration {}'.format(iteration),
            slot=(iteration, 0, len(buckets) + 1 if n_items is None
                  else n_items),
            priority=float('inf')))

    def wait_control(self):
        """Returns ``(level, all_loaded)`` agreed by all ranks."""
        buf, handle = self.control
        handle.wait()
        watchdog_module.check_control(buf, self.rank, self.size)
        return int(buf[0]), buf[1] == -1

    def sync_control(self):
        if self.control is not None:
            self.control[1].wait()

    def next_iteration(self):
        self.control = None

    # ------------------------------------------------------------------
    # (Re)building the layout: blocking, on every rank at the same point

    def build(self, target, observed, skip=None):
        """Checks, initialises and broadcasts; returns the new layout.

        Args:
            target (chainer.Link): the model.
            observed (list): this rank's gradient order before the first
                layout (rank 0's becomes the bucket order).
            skip (bool): whether this step is skipped; None decides it here
                (no layout yet, or ``setup()`` was called again), with the
                same rule the control message applies.

        Returns:
            ``(buckets, infos, skip)``.
        """
        comm = self.mpi_comm
        named = sorted(target.namedparams())
        groups = {n: getattr(p, 'reduction_group', None) for n, p in named}
        grouped = sorted(n for n, g in groups.items() if g is not None)
        mine = {n: ([list(p.shape), str(p.dtype)] if p.array is not None
                    else [None, None]) for n, p in named}
        whole = []
        if self.shard_unit == 'auto':
            from chainermn_overlap.optimizers.sharding import rules
            whole = [n for n, p in named if rules.whole_reason(p)]
        gathered = _mpi_json.allgather_json(
            comm, {'params': mine, 'loaded': bool(self.loaded),
                   'changes_step': self.changes_step(target),
                   'order': observed, 'grouped': grouped, 'whole': whole,
                   'options': self.options},
            what='the model description of a relayout',
            timeout=self.timeout)
        replicated = [(n, p) for n, p in named if groups[n] is None]
        # An error on one rank only (a parameter that cannot initialise
        # here) is raised on every rank before the broadcasts.
        with blocking.agreement(comm, 'the checks of a relayout',
                                self.timeout):
            self._check_same_options(gathered)
            self._check_same_model(named, gathered, set(grouped))
            self._check_groups(gathered, grouped, named)
            self._initialise(replicated, gathered)
        if skip is None:
            skip = (any(g['changes_step'] for g in gathered)
                    and not all(g['loaded'] for g in gathered))
        self._broadcast(replicated, gathered)
        self.grouped = [(n, p, groups[n]) for n, p in named
                        if groups[n] is not None]
        for n, p, group in self.grouped:
            # Blocks differ between groups: broadcast within the group, in
            # name order (the same on every member).
            bcast_array(group.mpi_comm, p.array, 0, self.timeout, n)
        # Kept whole if any rank's rules say so: every rank's check then
        # passes (sharding.rules).
        whole = set()
        for g in gathered:
            whole.update(g['whole'])
        plan = _mpi_json.bcast_json(
            comm, self._plan(replicated, gathered[0]['order'], whole)
            if self.rank == 0 else None, what='the bucket plan',
            timeout=self.timeout)
        by_name = dict(named)
        buckets, infos = [], []
        for index, item in enumerate(plan):
            dtype, entries = item[0], item[1]
            bplan = buckets_module.BucketPlan(
                numpy.dtype(dtype), tuple(tuple(e) for e in entries),
                sum(e[2] for e in entries))
            params = [by_name[e[0]] for e in entries]
            if self.shard_unit is None:
                bucket = buckets_module.Bucket(index, bplan, params)
            else:
                bucket = self._sharded(index, bplan, params, item[2])
            buckets.append(bucket)
            for i, (name, p) in enumerate(zip(bucket.names, params)):
                infos.append(ParamState(name, p, bucket, i))
        self.structure = _local_structure(target)
        self.loaded = False
        return buckets, infos, skip

    @staticmethod
    def _owners(n, gathered):
        return [r for r, g in enumerate(gathered)
                if g['params'][n][0] is not None]

    def _initialise(self, named, gathered):
        # Initialise what other ranks initialised (a lazily initialised link
        # that ran on some ranks only).
        for n, p in named:
            owners = self._owners(n, gathered)
            if owners and p.array is None:
                shape, dtype = gathered[owners[0]]['params'][n]
                p.initialize(tuple(shape))
                if str(p.dtype) != dtype:
                    raise ValueError(
                        'parameter {} initialises as {} on rank {} but as {} '
                        'on rank {}; give its initializer an explicit dtype.'
                        .format(n, p.dtype, self.rank, dtype, owners[0]))

    def _broadcast(self, named, gathered):
        # Every parameter from the lowest rank that has it (rank 0 whenever
        # it does).
        for n, p in named:
            owners = self._owners(n, gathered)
            if owners:
                bcast_array(self.mpi_comm, p.array, owners[0], self.timeout,
                            n)

    def _plan(self, named, observed, whole=()):
        # Rank 0's observed gradient order (backward order), then the rest
        # in reverse name order.
        mine = dict(named)
        order = [n for n in observed if n in mine]
        seen = set(order)
        order += [n for n, _ in reversed(named) if n not in seen]
        sizes = {n: p.size for n, p in named if p.array is not None}
        dtypes = {n: str(p.dtype) for n, p in named if p.array is not None}
        entries = [(n, sizes[n], dtypes[n]) for n in order if n in sizes]
        plans = buckets_module.plan_buckets(
            entries, self.bucket_size, self.allreduce_grad_dtype,
            tail=TAIL_BUCKETS if self.wait == 'forward' else ())
        out = [[str(b.dtype), [list(e) for e in b.entries]] for b in plans]
        if self.shard_unit is not None:
            from chainermn_overlap.optimizers.sharding import layout
            counts = layout.plan_counts(
                [[e[2] for e in b.entries] for b in plans], self.size,
                self.shard_unit,
                [[e[0] in whole for e in b.entries] for b in plans])
            for item, c in zip(out, counts):
                item.append(c)
        return out

    def _sharded(self, index, plan, params, counts):
        """A sharded bucket with its pieces (rank 0's, broadcast)."""
        from chainermn_overlap.optimizers.sharding import layout
        dtypes = {str(p.dtype) for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                'bucket {} mixes parameter dtypes {} (rank {}); shard= '
                'needs the parameters of a bucket to share one dtype: use '
                'shard=None for this model.'.format(
                    index, sorted(dtypes), self.rank))
        return layout.ShardedBucket(index, plan, params, counts,
                                    dtypes.pop())

    def _check_groups(self, gathered, grouped, named):
        if not grouped:
            return
        if not self.allow_groups:
            raise ValueError(
                'parameters {} are reduced within a group of processes '
                '(param.reduction_group, e.g. distconv channel blocks), '
                'which this optimizer does not support (rank {}); train '
                'with chainermn_overlap.create_overlapped_optimizer.'
                .format(grouped[:5], self.rank))
        for r, g in enumerate(gathered):
            if g['grouped'] != grouped:
                raise ValueError(
                    'ranks disagree on which parameters are reduced within a '
                    'group: rank {} has {}, rank {} has {}. Every rank must '
                    'build the same distconv model on the same grid.'.format(
                        self.rank, grouped[:5], r, g['grouped'][:5]))
        by_name = dict(named)
        for n in grouped:
            if by_name[n].array is None:
                raise ValueError(
                    'parameter {} is a block reduced within a group but is '
                    'not initialised on rank {}: give its link the input '
                    'size, or run one forward before the first update.'
                    .format(n, self.rank))

    def _check_same_options(self, gathered):
        first = gathered[0]['options']
        differ = sorted(k for k in set().union(*(g['options']
                                                  for g in gathered))
                        if any(g['options'].get(k) != first.get(k)
                               for g in gathered))
        if differ:
            raise ValueError(
                'the optimizer\'s options differ between ranks ({}) (seen on '
                'rank {}); they decide which collectives run: give every '
                'rank the same create_overlapped_optimizer(...) arguments.'
                .format('; '.join('rank {}: {}'.format(r, ', '.join(
                    '{}={!r}'.format(k, g['options'].get(k)) for k in differ))
                    for r, g in enumerate(gathered)), self.rank))

    def _check_same_model(self, named, gathered, grouped=()):
        names0 = sorted(gathered[0]['params'])
        for r, g in enumerate(gathered):
            names = sorted(g['params'])
            if names != names0:
                extra = sorted(set(names) - set(names0))
                missing = sorted(set(names0) - set(names))
                raise ValueError(
                    'the model differs between ranks: rank {} has parameters '
                    '{} that rank 0 lacks and lacks {} (seen on rank {}). '
                    'Every rank must build the same model before '
                    'create_overlapped_optimizer(...).setup(model).'.format(
                        r, extra[:5], missing[:5], self.rank))
        for n, _ in named:
            if n in grouped:
                continue   # a block of a different size on each group
            seen = {}
            for r, g in enumerate(gathered):
                shape, dtype = g['params'][n]
                if shape is not None:
                    seen.setdefault((tuple(shape), dtype), r)
            if len(seen) > 1:
                desc = '; '.join('rank {}: {}'.format(r, _describe(k))
                                 for k, r in seen.items())
                raise ValueError(
                    'parameter {} differs between ranks ({}) (seen on rank '
                    '{}). Every rank must build the same model.'.format(
                        n, desc, self.rank))
