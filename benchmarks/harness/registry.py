"""The studies of ``python -m benchmarks``: their names, modules and lines.

A study is one module of ``benchmarks/`` that measures one thing and writes
its results file; it has a module docstring (its first sentence is the line
``--list`` prints) and runs as ``python -m benchmarks NAME [its options]``,
which runs the module as ``__main__`` with the options (so each study keeps
its own argparse).  Add a study by adding a line to :data:`STUDIES`.
"""
import ast
import importlib.util
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# (name, module): the name of ``python -m benchmarks NAME``, in the order
# ``--list`` prints them.
STUDIES = (
    ('overlap', 'benchmarks.overlap_bench'),
    ('compression', 'benchmarks.compression_bench'),
    ('accuracy', 'benchmarks.accuracy'),
    ('comm_cost', 'benchmarks.comm_cost'),
    ('overhead', 'benchmarks.overhead'),
    ('powersgd_kernels', 'benchmarks.powersgd_kernels'),
    ('sharding', 'benchmarks.sharding_bench'),
    ('snapshot', 'benchmarks.snapshot_bench'),
    ('peers', 'benchmarks.peers_bench'),
    ('peers_sharding', 'benchmarks.peers_sharding'),
    ('hosts_soak', 'benchmarks.hosts_soak'),
    ('spatial', 'benchmarks.spatial_bench'),
    ('unet', 'benchmarks.unet_bench'),
    ('channel_tiling', 'benchmarks.channel_tiling_bench'),
    ('halo_ab', 'benchmarks.halo_ab'),
    ('spatial_profile', 'benchmarks.spatial_profile'),
    ('distconv_hashes', 'benchmarks.distconv_hashes'),
    ('gpu', 'benchmarks.gpu_bench'),
    ('gpu_offline', 'benchmarks.gpu_offline'),
    ('startup', 'benchmarks.startup'),
    ('scale', 'benchmarks.scale_bench'),
    ('ab', 'benchmarks.harness.ab'),
)


class UnknownStudy(KeyError):
    """A name that is no study's (nor its module's)."""


def module_of(name):
    """The module of study ``name``; its module's last part works too
    (``overlap_bench`` for ``overlap``)."""
    for study, module in STUDIES:
        if name in (study, module.rpartition('.')[2], module):
            return module
    raise UnknownStudy(name)


def _path(module):
    spec = importlib.util.find_spec(module)
    return spec.origin


def description(module):
    """The first sentence of ``module``'s docstring, read without
    importing it (a study may need packages ``--list`` does not)."""
    with open(_path(module), encoding='utf-8') as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ''
    para = ' '.join(doc.split('\n\n')[0].split())
    return para.split('. ')[0].rstrip('.')


def listing():
    """``--list``'s lines: each study's name and line."""
    width = max(len(s) for s, _ in STUDIES)
    return ['{:<{}}  {}'.format(s, width, description(m)) for s, m in STUDIES]


def run(name, argv):
    """Run study ``name`` as ``python -m MODULE ARGV`` would."""
    module = module_of(name)
    sys.argv = [_path(module)] + list(argv)
    runpy.run_module(module, run_name='__main__', alter_sys=True)
