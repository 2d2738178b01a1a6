"""Host lists from a batch scheduler's allocation: Slurm, PBS/Torque, LSF.

Inside a batch job the scheduler says which hosts the job holds and how
many tasks each may run; ``--hosts-from slurm|pbs|lsf`` (or ``auto``: the
first whose variables are set) turns that into the launcher's host list:

* Slurm: ``SLURM_JOB_NODELIST`` (``node[01-04,07],gpu-a1``, ranges with
  their zero padding) and ``SLURM_TASKS_PER_NODE`` (``2(x3),1``: counts
  for the nodes in order; without it, 1 per node);
* PBS/Torque: the file ``PBS_NODEFILE`` names, one line per slot;
* LSF: ``LSB_MCPU_HOSTS`` (``hostA 4 hostB 4``).

Everything read is checked like a hostfile
(:func:`~chainermn_overlap.launch._hosts.parse_hosts`): a name that is no
host name or address is refused, with where it came from.
"""
import os
import re

from chainermn_overlap import config
from chainermn_overlap.launch._hosts import parse_hosts

SOURCES = ('slurm', 'pbs', 'lsf')
_RANGE = re.compile(r'^(\d+)(?:-(\d+))?$')
_COUNT = re.compile(r'^(\d+)(?:\(x(\d+)\))?$')
# A range this long is a typo, not an allocation.
_MOST_HOSTS = 100000


def expand_nodelist(text):
    """Slurm's compressed host list, expanded in order.

    ``node[01-03,07],login`` -> ``['node01', 'node02', 'node03', 'node07',
    'login']``; brackets may appear more than once in a name
    (``r[1-2]n[1-2]``: every combination).

    Raises:
        ValueError: unbalanced brackets, a range that is not ``N`` or
            ``N-M`` with N <= M, or more than 100000 hosts.
    """
    names = []
    for part in _split_top(text):
        names.extend(_expand_one(part, text))
        if len(names) > _MOST_HOSTS:
            raise ValueError('launch: SLURM_JOB_NODELIST {!r} names more '
                             'than {} hosts.'.format(text, _MOST_HOSTS))
    return names


def _split_top(text):
    """Splits at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == '[':
            depth += 1
        elif c == ']':
            depth -= 1
        elif c == ',' and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise ValueError('launch: SLURM_JOB_NODELIST {!r}: brackets do '
                             'not pair.'.format(text))
    if depth:
        raise ValueError('launch: SLURM_JOB_NODELIST {!r}: brackets do not '
                         'pair.'.format(text))
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_one(part, whole):
    open_at = part.find('[')
    if open_at < 0:
        return [part]
    close_at = part.index(']', open_at)
    head, body, tail = part[:open_at], part[open_at + 1:close_at], \
        part[close_at + 1:]
    out = []
    for item in body.split(','):
        m = _RANGE.match(item.strip())
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError('launch: SLURM_JOB_NODELIST {!r}: {!r} is not a '
                             'range (N or N-M, N <= M).'.format(whole, item))
        first, last = m.group(1), m.group(2) or m.group(1)
        if int(last) - int(first) > _MOST_HOSTS:
            raise ValueError('launch: SLURM_JOB_NODELIST {!r} names more '
                             'than {} hosts.'.format(whole, _MOST_HOSTS))
        width = len(first)
        for n in range(int(first), int(last) + 1):
            out.extend(head + str(n).zfill(width) + rest
                       for rest in _expand_one(tail, whole))
    return out


def expand_counts(text, hosts):
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per host."""
    counts = []
    for item in text.split(','):
        m = _COUNT.match(item.strip())
        if not m:
            raise ValueError('launch: SLURM_TASKS_PER_NODE {!r}: {!r} is not '
                             'N or N(xK).'.format(text, item))
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    if len(counts) != hosts:
        raise ValueError(
            'launch: SLURM_TASKS_PER_NODE {!r} gives {} counts for the {} '
            'hosts of SLURM_JOB_NODELIST.'.format(text, len(counts), hosts))
    return counts


def _slurm(env):
    job_nodes, nodes = config.SLURM_NODELIST_ENVS
    nodes = env.get(job_nodes, env.get(nodes))
    if not nodes:
        return None
    names = expand_nodelist(nodes)
    tasks = env.get(config.SLURM_TASKS_ENV)
    counts = (expand_counts(tasks, len(names)) if tasks
              else [1] * len(names))
    return parse_hosts('\n'.join('{}:{}'.format(n, c)
                                 for n, c in zip(names, counts)),
                       job_nodes)


def _pbs(env):
    path = env.get(config.PBS_NODEFILE_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            lines = [ln.split('#', 1)[0].strip() for ln in f]
    except OSError as e:
        raise ValueError('launch: cannot read PBS_NODEFILE {} ({}).'.format(
            path, e.strerror)) from e
    counts = {}
    for name in lines:
        if name:
            counts[name] = counts.get(name, 0) + 1
    return parse_hosts('\n'.join('{}:{}'.format(n, c)
                                 for n, c in counts.items()),
                       'PBS_NODEFILE {}'.format(path))


def _lsf(env):
    text = env.get(config.LSF_HOSTS_ENV)
    if not text:
        return None
    words = text.split()
    if len(words) % 2 or not all(w.isdigit() for w in words[1::2]):
        raise ValueError('launch: LSB_MCPU_HOSTS {!r} is not "host N host N '
                         '...".'.format(text))
    return parse_hosts('\n'.join('{}:{}'.format(h, n) for h, n in
                                 zip(words[::2], words[1::2])),
                       config.LSF_HOSTS_ENV)


_READERS = {'slurm': _slurm, 'pbs': _pbs, 'lsf': _lsf}
_VARIABLES = {'slurm': config.SLURM_NODELIST_ENVS[0],
              'pbs': config.PBS_NODEFILE_ENV, 'lsf': config.LSF_HOSTS_ENV}


def hosts_from(source, env=None):
    """The host list of scheduler ``source`` (or ``auto``).

    Raises:
        ValueError: an unknown source, no allocation in the environment,
            or one that is not a host list.
    """
    env = os.environ if env is None else env
    if source == 'auto':
        for name in SOURCES:
            hosts = _READERS[name](env)
            if hosts is not None:
                return hosts
        raise ValueError(
            'launch: --hosts-from auto found no batch allocation ({} unset); '
            'run inside a Slurm, PBS or LSF job, or give --hostfile.'.format(
                ', '.join(_VARIABLES[n] for n in SOURCES)))
    if source not in _READERS:
        raise ValueError('launch: --hosts-from {!r}: give one of {} or '
                         'auto.'.format(source, ', '.join(SOURCES)))
    hosts = _READERS[source](env)
    if not hosts:
        raise ValueError(
            'launch: --hosts-from {}: {} is not set or lists no host; run '
            'inside a {} job, or give --hostfile.'.format(
                source, _VARIABLES[source], source.upper()
                if source != 'slurm' else 'Slurm'))
    return hosts
