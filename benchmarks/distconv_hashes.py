"""Fingerprints (sha256) of distconv outputs and gradients, for bit-identity.

Run (from the repository root; ``PYTHONPATH`` picks the source tree whose
``chainermn_overlap`` is fingerprinted, e.g. an older checkout)::

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/distconv_hashes.py \\
        --out /tmp/hashes_np2.json
    PYTHONPATH=/tmp/base .venv/bin/mpiexec -n 2 .venv/bin/python \\
        benchmarks/distconv_hashes.py --out /tmp/base_np2.json
    .venv/bin/python benchmarks/distconv_hashes.py --compare \\
        /tmp/base_np2.json /tmp/hashes_np2.json

Runs representative forward/backward cases of every distconv part at the
launched process count (2 or 4 give the grids below; other sizes run what
fits): convolution (2-D and 3-D, blocking and overlapped halos, narrow and
wide halos, stride, dilation, no padding), max/average/global pooling,
batch normalisation (running statistics included), the tiled stack,
channel-parallel convolutions (overlapped and serial), redistribution
(spatial <-> sample layout, replication), the bare region exchange, and a
ResNet bottleneck of the spatial example. Every output, input gradient,
parameter gradient and running statistic of every rank is hashed (dtype,
shape and bytes). ``--compare`` lists every difference and exits 1 if any.
The inputs are fixed by seeds, so two runs of the same tree agree.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import sys

import chainer
import chainer.functions as F
import numpy as np


def _digest(arr):
    arr = np.ascontiguousarray(np.asarray(arr))
    h = hashlib.sha256()
    h.update(('%s %r ' % (arr.dtype.str, arr.shape)).encode())
    h.update(arr.tobytes())
    return h.hexdigest()


class Cases(object):
    """The cases for one communicator; results are ``{case: {name: sha}}``."""

    def __init__(self, comm):
        from chainermn_overlap import distconv
        self.dc = distconv
        self.comm = comm
        self.size = comm.size
        self.results = {}
        self._grids = {}

    def grid(self, shape, **kw):
        key = (tuple(shape), tuple(sorted(kw.items())))
        if key not in self._grids:
            self._grids[key] = self.dc.SpatialGrid(self.comm, shape, **kw)
        return self._grids[key]

    def fits(self, shape, channels=1):
        return self.size % (int(np.prod(shape)) * channels) == 0

    def record(self, case, **arrays):
        out = self.results.setdefault(case, {})
        for name, arr in sorted(arrays.items()):
            if arr is None:
                continue
            if isinstance(arr, chainer.Variable):
                arr = arr.array
            out[name] = _digest(arr)

    def run_layer(self, case, g, x, fn, params=(), channel_split=False,
                  seed=0):
        """Scatters ``x``, runs ``fn`` and its backward, records it all."""
        xd = chainer.Variable(g.scatter(x, channel_split=channel_split))
        y = fn(xd)
        rng = np.random.RandomState(seed + 100 * g.rank + 1)
        y.grad = rng.randn(*y.shape).astype(y.dtype)
        y.backward()
        arrays = {'y': y.array, 'gx': xd.grad}
        for name, p in params:
            arrays['grad_' + name] = p.grad
        self.record(case, **arrays)
        return y

    # -- the cases ------------------------------------------------------
    def convolutions(self):
        dc = self.dc
        rng = np.random.RandomState(1)
        x = rng.randn(3, 4, 11, 9).astype(np.float32)
        convs = [  # (name, ksize, stride, pad, dilate)
            ('k3p1', 3, 1, 1, 1), ('k3s2p1', 3, 2, 1, 1),
            ('k5d2p4', 5, 1, 4, 2), ('k3p0', 3, 1, 0, 1),
            ('k7s2p3', 7, 2, 3, 1)]
        grids = [s for s in [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]
                 if self.fits(s)]
        for shape in grids:
            for overlap in (False, True):
                g = self.grid(shape, progress_min_cells=1)
                g.overlap = overlap
                for name, k, s, p, d in convs:
                    W = chainer.Parameter(
                        rng.randn(5, 4, k, k).astype(np.float32))
                    b = chainer.Parameter(rng.randn(5).astype(np.float32))
                    self.run_layer(
                        'conv2d-%s-%r-ov%d' % (name, shape, overlap), g, x,
                        lambda v: dc.convolution_2d(g, v, W, b, s, p,
                                                    dilate=d),
                        [('W', W), ('b', b)])
                g.overlap = True
        x3 = rng.randn(2, 3, 6, 7, 5).astype(np.float32)
        for shape in [s for s in [(2, 1, 1), (1, 2, 2), (1, 1, 2)]
                      if self.fits(s)]:
            for overlap in (False, True):
                g = self.grid(shape, progress_min_cells=1)
                g.overlap = overlap
                W = chainer.Parameter(
                    rng.randn(4, 3, 3, 3, 3).astype(np.float32))
                self.run_layer(
                    'conv3d-%r-ov%d' % (shape, overlap), g, x3,
                    lambda v: dc.convolution_nd(g, v, W, None, 1, 1),
                    [('W', W)])
                g.overlap = True

    def poolings(self):
        dc = self.dc
        rng = np.random.RandomState(2)
        x = rng.randn(2, 3, 10, 13).astype(np.float32)
        for shape in [s for s in [(2, 1), (2, 2), (1, 4)] if self.fits(s)]:
            for overlap in (False, True):
                g = self.grid(shape, progress_min_cells=1)
                g.overlap = overlap
                tag = '%r-ov%d' % (shape, overlap)
                self.run_layer('maxpool-k3s2p1-' + tag, g, x,
                               lambda v: dc.max_pooling_2d(g, v, 3, 2, 1,
                                                           cover_all=False))
                self.run_layer('maxpool-k7-' + tag, g, x,
                               lambda v: dc.max_pooling_2d(g, v, 7, 1, 3))
                self.run_layer('avgpool-none-' + tag, g, x,
                               lambda v: dc.average_pooling_nd(
                                   g, v, 3, 1, 1, pad_value=None))
                self.run_layer('gap-' + tag, g, x,
                               lambda v: dc.global_average_pooling(g, v))
                g.overlap = True

    def batch_norm(self):
        dc = self.dc
        rng = np.random.RandomState(3)
        x = (rng.randn(4, 5, 9, 7) * 3 + 1).astype(np.float32)
        for shape in [s for s in [(2, 1), (2, 2), (4, 1)] if self.fits(s)]:
            g = self.grid(shape)
            bn = dc.BatchNormalization(
                g, 5, initial_gamma=rng.randn(5).astype(np.float32),
                initial_beta=rng.randn(5).astype(np.float32))
            case = 'bn-%r' % (shape,)
            self.run_layer(case, g, x, bn, [('gamma', bn.gamma),
                                            ('beta', bn.beta)])
            self.record(case, avg_mean=bn.avg_mean, avg_var=bn.avg_var)

    def tiled(self):
        dc = self.dc
        rng = np.random.RandomState(4)
        x = rng.randn(2, 3, 12, 10).astype(np.float32)
        for shape in [s for s in [(2, 1), (2, 2), (1, 4)] if self.fits(s)]:
            g = self.grid(shape)
            c1 = dc.Convolution2D(g, 3, 4, 3, pad=1, initialW=rng.randn(
                4, 3, 3, 3).astype(np.float32))
            bn = dc.BatchNormalization(g, 4)
            c2 = dc.Convolution2D(g, 4, 4, 3, pad=1, initialW=rng.randn(
                4, 4, 3, 3).astype(np.float32))
            for depth in (1, 2):
                stack = dc.Tiled(g, [c1, bn, F.relu, c2], depth=depth)
                for p in stack.params():
                    p.cleargrad()
                case = 'tiled-d%d-%r' % (depth, shape)
                self.run_layer(case, g, x, stack,
                               [('c1W', c1.W), ('c1b', c1.b),
                                ('c2W', c2.W), ('gamma', bn.gamma),
                                ('beta', bn.beta)])
                self.record(case, avg_mean=bn.avg_mean, avg_var=bn.avg_var)

    def channel_convs(self):
        dc = self.dc
        rng = np.random.RandomState(5)
        x = rng.randn(3, 7, 6, 7).astype(np.float32)
        grids = [((1, 1), self.size)] if self.size > 1 else []
        if self.fits((2, 1), 2) and self.size >= 4:
            grids.append(((2, 1), 2))
        for shape, channels in grids:
            g = self.grid(shape, channels=channels)
            for overlap in (True, False):
                g.channel_overlap = overlap
                tag = '%r-c%d-ov%d' % (shape, channels, overlap)
                lo, hi = g.channel_range(7)
                Wc = rng.randn(5, 7, 3, 3).astype(np.float32)
                Wd = chainer.Parameter(Wc[:, lo:hi].copy())
                bd = chainer.Parameter(rng.randn(5).astype(np.float32))
                self.run_layer(
                    'chconv-scatter-' + tag, g, x,
                    lambda v: dc.convolution_2d(g, v, Wd, bd, 1, 1,
                                                split='channel',
                                                split_output=True),
                    [('W', Wd), ('b', bd)], channel_split=True)
                olo, ohi = g.channel_range(6)
                Wf = rng.randn(6, 7, 3, 3).astype(np.float32)
                Wd2 = chainer.Parameter(Wf[olo:ohi].copy())
                bd2 = chainer.Parameter(
                    rng.randn(6).astype(np.float32)[olo:ohi].copy())
                self.run_layer(
                    'chconv-gather-' + tag, g, x,
                    lambda v: dc.convolution_2d(g, v, Wd2, bd2, 2, 1,
                                                split='filter',
                                                split_input=True),
                    [('W', Wd2), ('b', bd2)], channel_split=True)
                self.run_layer(
                    'chconv-gatherch-' + tag, g, x,
                    lambda v: dc.gather_channels(g, v), channel_split=True)
            g.channel_overlap = True

    def redistribution(self):
        dc = self.dc
        rng = np.random.RandomState(6)
        x = rng.randn(5, 3, 9, 6).astype(np.float32)
        for shape in [s for s in [(2, 1), (1, 2), (2, 2), (4, 1)]
                      if self.fits(s)]:
            g = self.grid(shape)
            tag = '%r' % (shape,)

            def there_and_back(v):
                h = dc.to_sample_layout(g, v)
                h = h * h
                return dc.to_spatial_layout(g, h)

            self.run_layer('shuffle-' + tag, g, x, there_and_back)
            self.run_layer('to_sample-' + tag, g, x,
                           lambda v: dc.to_sample_layout(g, v))
            self.run_layer('replicate-' + tag, g, x,
                           lambda v: dc.to_replicated(g, v))

    def exchanges(self):
        dc = self.dc
        geometry = dc.geometry
        rng = np.random.RandomState(7)
        cases = [('2d', (10, 9), (2, 1), 1), ('2d', (10, 9), (2, 2), 1),
                 ('2d', (10, 9), (1, 2), 6), ('2d', (10, 9), (2, 1), 7),
                 ('2d', (10, 9), (1, 4), 3), ('2d', (10, 9), (2, 2), 4),
                 ('3d', (6, 5, 7), (2, 1, 1), 1),
                 ('3d', (6, 5, 7), (1, 2, 2), 2)]
        for tag, gshape, shape, halo in cases:
            if not self.fits(shape):
                continue
            g = self.grid(shape)
            P = g.spatial_size
            owns = [geometry.block_box(gshape, shape,
                                       geometry.grid_coords(shape, r))
                    for r in range(P)]
            needed = [tuple((lo - halo, hi + halo) for lo, hi in own)
                      for own in owns]
            plan = geometry.exchange_plan(gshape, shape, needed,
                                          g.spatial_rank)
            x = rng.randn(2, 3, *gshape).astype(np.float32)
            self.run_layer(
                'exchange-%s-%r-h%d' % (tag, shape, halo), g, x,
                lambda v: dc.region_exchange(g, v, plan, 0))

    def resnet_block(self):
        here = os.path.dirname(os.path.dirname(os.path.abspath(
            sys.modules['chainermn_overlap'].__file__)))
        path = os.path.join(here, 'examples', 'spatial',
                            'train_resnet50_spatial.py')
        spec = importlib.util.spec_from_file_location('_resnet_spatial',
                                                      path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        rng = np.random.RandomState(8)
        x = rng.randn(2, 8, 12, 12).astype(np.float32)
        for shape in [s for s in [(2, 1), (2, 2), (1, 4)] if self.fits(s)]:
            g = self.grid(shape)
            np.random.seed(0)  # HeNormal draws from numpy's global state
            block = mod.Bottleneck(mod.Layers(g, 'spatial'), 8, 4, 16, 2)
            case = 'resnet-bottleneck-%r' % (shape,)
            self.run_layer(case, g, x, block,
                           sorted(block.namedparams()))
            self.record(case, **{
                'avg%s_%s' % (path.replace('/', '_'), stat):
                getattr(link, 'avg_' + stat)
                for path, link in sorted(block.namedlinks(skipself=True))
                if hasattr(link, 'avg_mean') for stat in ('mean', 'var')})

    def all(self):
        for part in (self.convolutions, self.poolings, self.batch_norm,
                     self.tiled, self.channel_convs, self.redistribution,
                     self.exchanges, self.resnet_block):
            part()
        return self.results


def _compare(a_path, b_path):
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    diffs = []
    if a['size'] != b['size']:
        diffs.append('process counts differ: %d vs %d'
                     % (a['size'], b['size']))
    n = 0
    for rank, (ra, rb) in enumerate(zip(a['ranks'], b['ranks'])):
        for case in sorted(set(ra) | set(rb)):
            ca, cb = ra.get(case, {}), rb.get(case, {})
            for name in sorted(set(ca) | set(cb)):
                n += 1
                if ca.get(name) != cb.get(name):
                    diffs.append('rank %d %s %s: %s vs %s' % (
                        rank, case, name, ca.get(name, 'missing'),
                        cb.get(name, 'missing')))
    print('%s (%s) vs %s (%s): %d arrays compared, %d differ'
          % (a_path, a['package'], b_path, b['package'], n, len(diffs)))
    for d in diffs[:50]:
        print('  ' + d)
    return 1 if diffs or n == 0 else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', help='JSON file to write (rank 0)')
    p.add_argument('--compare', nargs=2, metavar=('A', 'B'),
                   help='compare two JSON files and exit')
    args = p.parse_args(argv)
    if args.compare:
        return _compare(*args.compare)
    import chainermn
    import chainermn_overlap
    comm = chainermn.create_communicator('naive')
    chainer.config.train = True
    results = Cases(comm).all()
    every = comm.mpi_comm.gather(results, root=0)
    if comm.rank == 0:
        doc = {'size': comm.size,
               'package': os.path.dirname(chainermn_overlap.__file__),
               'cases': len(results),
               'arrays': sum(len(v) for r in every for v in r.values()),
               'ranks': every}
        if args.out:
            with open(args.out, 'w') as f:
                json.dump(doc, f, indent=1, sort_keys=True)
        print('%d cases, %d arrays hashed at %d processes (%s)'
              % (doc['cases'], doc['arrays'], comm.size, doc['package']))
    return 0


if __name__ == '__main__':
    sys.exit(main())
