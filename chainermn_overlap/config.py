"""Options and environment variables, parsed in one place.

Every option of the library that is a size, a duration or a rate is parsed
here, and every environment variable is named and read here (the functions
below; ``tests/unit/test_config.py`` fails if another module of the package
spells or reads one), so that each spelling is accepted (and each mistake
reported) the same way everywhere.

This module imports only the standard library: the launcher's per-rank
parent (:mod:`chainermn_overlap.launch._rank`) loads it by path, without
the package.

Environment variables.  Pass the same value to every rank (for example
``mpiexec -genv NAME VALUE``): settings that start collectives (the stall
inspector) must agree between ranks; the engines check that they do (one
tiny allreduce) and raise on every rank when they do not.

``CHAINERMN_OVERLAP_TIMEOUT`` (:data:`TIMEOUT_ENV`)
    Watchdog: seconds any wait for a reduction may take before
    :class:`~chainermn_overlap.CommunicationTimeout` is raised.  Default
    600 (:data:`DEFAULT_TIMEOUT`); ``0`` or ``none`` disables; set but
    empty is an error (not "off").  The optimizers' ``timeout=`` option wins
    over it.
``CHAINERMN_OVERLAP_STALL_WARNING`` (:data:`STALL_WARNING_ENV`)
    Stall diagnosis: seconds of waiting before (and between)
    :class:`~chainermn_overlap.StallWarning` reports that name the ranks
    which have not posted the awaited collective.  Default off.  The
    ``stall_warning=`` option wins over it.
``CHAINERMN_OVERLAP_DEBUG`` (:data:`DEBUG_ENV`)
    ``1``: before each collective every engine checks that all ranks post
    the same one (one extra tiny allreduce each).  Default off; the
    ``debug=`` option wins over it.
``CHAINERMN_OVERLAP_EMULATION`` (:data:`EMULATION_ENV`)
    Link of the ``'emulated'`` engine, as ``nodes=16,bandwidth=10gbit,
    latency=25us`` (any subset; the rest from :data:`EMULATION_DEFAULTS`).
``CHAINERMN_OVERLAP_ABORT_ON_EXCEPTION`` (:data:`ABORT_ON_EXCEPTION_ENV`)
    ``1``: importing ``chainermn_overlap`` calls
    :func:`~chainermn_overlap.enable_abort_on_exception`, so that an
    uncaught exception on one rank ends the whole job.
``CHAINERMN_OVERLAP_RESTART`` (:data:`RESTART_ENV`)
    Set by the restarting launcher (``python -m chainermn_overlap.launch``)
    for every rank: the attempt number, 0 on the first attempt, then 1, 2,
    ...
``CHAINERMN_OVERLAP_PROGRESS_FILE`` (:data:`PROGRESS_FILE_ENV`)
    Where :func:`~chainermn_overlap.extensions.auto_snapshot` records
    resumes and snapshots (JSON lines written by rank 0): a file, or ``-``
    for tagged lines on standard output, which is what the launcher sets
    (it reads them from the job's output, from any host), so that it can
    tell an attempt that made progress from one that did not.
``CHAINERMN_OVERLAP_LAUNCH_DEATHS`` (:data:`LAUNCH_DEATHS_ENV`)
    Set (to ``-``) by the launcher for its per-rank parent processes: each
    then writes one tagged line to stderr when its rank ended abnormally.
``CHAINERMN_OVERLAP_LAUNCH_ID`` (:data:`LAUNCH_ID_ENV`)
    Set by the launcher for every rank (mpiexec's ``-genv``): the job and
    attempt (``JOB:ATTEMPT``), by which it finds and ends what is left of
    an attempt on each host.
``CHAINERMN_OVERLAP_LAUNCH_KEY`` (:data:`LAUNCH_KEY_ENV`)
    Set by the launcher for every attempt: a random key its ranks write into
    each record they report in their output (events of auto_snapshot, death
    records; :func:`report_line`), so that no line a program prints can
    pass for one.
``CHAINERMN_OVERLAP_LOCAL_RANK`` (:data:`LOCAL_RANK_ENV`)
    Set by the launcher's per-rank parent for its rank: the rank's number
    among the ranks on its host (0, 1, ... in rank order; from the process
    manager's ``MPI_LOCALRANKID``), e.g. to pick a GPU.
``CHAINERMN_OVERLAP_NATIVE`` (:data:`NATIVE_ENV`)
    ``0``: do not use the fused C kernels (float16 conversion, PowerSGD)
    even where they were built; numpy does the same arithmetic.  Default
    on.  The float16 results are bit-identical either way; PowerSGD's sums
    are rounded in another order, so give every rank the same setting.
``CHAINERMN_OVERLAP_NO_COMPAT`` (:data:`NO_COMPAT_ENV`)
    ``1``: the start-up file ``chainermn_overlap-compat.pth`` leaves
    Chainer's imports alone (no stand-ins for ``numpy.distutils`` and
    ``pkg_resources`` where they are missing; then ``import chainer`` fails
    on Python 3.12+).  Read at interpreter start-up by the top-level module
    ``_chainermn_overlap_compat``, which cannot import this package (it
    must act before Chainer is imported); the name is the same constant.
Read from others (:data:`FOREIGN_VARIABLES`): the process manager's
``PMI_FD``, ``PMI_RANK`` and ``MPI_LOCALRANKID`` (the launcher's per-rank
parent) and the batch schedulers' allocations (``SLURM_JOB_NODELIST`` or
``SLURM_NODELIST`` with ``SLURM_TASKS_PER_NODE``, ``PBS_NODEFILE``,
``LSB_MCPU_HOSTS``; :mod:`chainermn_overlap.launch`).

Flags (``DEBUG``, ``ABORT_ON_EXCEPTION``) are off when unset, empty, ``0``,
``false``, ``no`` or ``off``, and on otherwise.
"""
import math
import os
import re
from typing import Any, Dict, Optional, Union

__all__ = [
    'ABORT_ON_EXCEPTION_ENV', 'DEBUG_ENV', 'DEFAULT_TIMEOUT',
    'EMULATION_DEFAULTS', 'EMULATION_ENV', 'ENVIRONMENT_VARIABLES',
    'FOREIGN_VARIABLES', 'LAUNCH_DEATHS_ENV', 'LAUNCH_ID_ENV',
    'LAUNCH_KEY_ENV', 'LOCAL_RANK_ENV', 'LSF_HOSTS_ENV', 'MPI_LOCALRANKID_ENV',
    'NATIVE_ENV', 'NO_COMPAT_ENV', 'PBS_NODEFILE_ENV', 'PMI_FD_ENV',
    'PMI_RANK_ENV', 'PROGRESS_FILE_ENV', 'RESTART_ENV', 'SLURM_NODELIST_ENVS',
    'SLURM_TASKS_ENV', 'STALL_WARNING_ENV', 'TIMEOUT_ENV', 'launch_deaths',
    'launch_key', 'launcher_attempt', 'local_rank_id', 'parse_delay',
    'parse_duration', 'parse_emulation_settings', 'parse_flag', 'parse_rate',
    'parse_seconds', 'parse_size', 'pmi_fd', 'pmi_rank', 'progress_file',
    'report_line', 'resolve_abort_on_exception', 'resolve_debug',
    'resolve_emulation', 'resolve_native', 'resolve_stall_warning',
    'resolve_timeout',
]

Number = Union[int, float]

TIMEOUT_ENV = 'CHAINERMN_OVERLAP_TIMEOUT'
STALL_WARNING_ENV = 'CHAINERMN_OVERLAP_STALL_WARNING'
DEBUG_ENV = 'CHAINERMN_OVERLAP_DEBUG'
EMULATION_ENV = 'CHAINERMN_OVERLAP_EMULATION'
ABORT_ON_EXCEPTION_ENV = 'CHAINERMN_OVERLAP_ABORT_ON_EXCEPTION'
RESTART_ENV = 'CHAINERMN_OVERLAP_RESTART'
PROGRESS_FILE_ENV = 'CHAINERMN_OVERLAP_PROGRESS_FILE'
LAUNCH_DEATHS_ENV = 'CHAINERMN_OVERLAP_LAUNCH_DEATHS'
LAUNCH_ID_ENV = 'CHAINERMN_OVERLAP_LAUNCH_ID'
LAUNCH_KEY_ENV = 'CHAINERMN_OVERLAP_LAUNCH_KEY'
LOCAL_RANK_ENV = 'CHAINERMN_OVERLAP_LOCAL_RANK'
NATIVE_ENV = 'CHAINERMN_OVERLAP_NATIVE'
NO_COMPAT_ENV = 'CHAINERMN_OVERLAP_NO_COMPAT'
ENVIRONMENT_VARIABLES = (
    TIMEOUT_ENV, STALL_WARNING_ENV, DEBUG_ENV, EMULATION_ENV,
    ABORT_ON_EXCEPTION_ENV, RESTART_ENV, PROGRESS_FILE_ENV,
    LAUNCH_DEATHS_ENV, LAUNCH_ID_ENV, LAUNCH_KEY_ENV, LOCAL_RANK_ENV,
    NATIVE_ENV, NO_COMPAT_ENV)

# Set by others: MPICH's process manager (Hydra) for each rank ...
PMI_FD_ENV = 'PMI_FD'
PMI_RANK_ENV = 'PMI_RANK'
MPI_LOCALRANKID_ENV = 'MPI_LOCALRANKID'
# ... and the batch schedulers, inside a job's allocation.
SLURM_NODELIST_ENVS = ('SLURM_JOB_NODELIST', 'SLURM_NODELIST')
SLURM_TASKS_ENV = 'SLURM_TASKS_PER_NODE'
PBS_NODEFILE_ENV = 'PBS_NODEFILE'
LSF_HOSTS_ENV = 'LSB_MCPU_HOSTS'
FOREIGN_VARIABLES = (PMI_FD_ENV, PMI_RANK_ENV, MPI_LOCALRANKID_ENV) + \
    SLURM_NODELIST_ENVS + (SLURM_TASKS_ENV, PBS_NODEFILE_ENV, LSF_HOSTS_ENV)

# Like PyTorch's NCCL watchdog: generous enough for a slow first iteration
# or a snapshot written by one rank, short enough not to bill hours.
DEFAULT_TIMEOUT = 600.0
# The anchor setting of the emulated engine: 16 nodes on 10 Gb/s Ethernet.
# 25 us per ring step is a typical TCP small-message latency there.
EMULATION_DEFAULTS = {'nodes': 16, 'bandwidth': 10e9, 'latency': 25e-6}

_DISABLED = ('none', 'off', 'inf', 'infinity', 'never', 'false', 'no')
_FALSE = ('', '0', 'false', 'no', 'off')
_SIZE_UNITS = {'': 1, 'b': 1, 'kb': 10 ** 3, 'mb': 10 ** 6, 'gb': 10 ** 9,
               'kib': 2 ** 10, 'mib': 2 ** 20, 'gib': 2 ** 30}
_RATE_UNITS = {'': 1, 'bit': 1, 'kbit': 1e3, 'mbit': 1e6, 'gbit': 1e9}
_TIME_UNITS = {'': 1, 's': 1, 'ms': 1e-3, 'us': 1e-6}
_DIGITS = r'[0-9]*\.?[0-9]+'
_EXPONENT = r'(?:e-?[0-9]+)?'


def _number_with_unit(text: str, units: Dict[str, float],
                      exponent: bool = True) -> Optional[float]:
    """``float(number) * units[unit]`` for ``'<number><unit>'``, or None."""
    number = _DIGITS + (_EXPONENT if exponent else '')
    m = re.fullmatch(r'\s*(' + number + r')\s*([a-z]*)\s*', text.lower())
    if m is None or m.group(2) not in units:
        return None
    return float(m.group(1)) * units[m.group(2)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _quantity(value, units, what, plain, example, unit_names, more=''):
    """A number, or the number of a string with one of ``units``."""
    number = value
    if isinstance(value, str):
        number = _number_with_unit(value, units)
        if number is None:
            raise ValueError(
                '{} {!r} is not understood; give {} or a number with {}, '
                'e.g. {}{}'.format(what, value, plain, unit_names, example,
                                   more))
    if not _is_number(number):
        raise ValueError('{} must be {} or a string such as {}, got {!r}'
                         .format(what, plain, example, value))
    return number


# ----------------------------------------------------------------------------
# Parsers

def parse_size(value: Union[Number, str]) -> int:
    """Parses a size: bytes as a number, or a string like ``'25MB'``.

    Units ``B``, ``KB``, ``MB``, ``GB`` (powers of 10) and ``KiB``, ``MiB``,
    ``GiB`` (powers of 2), in any case.

    Returns:
        int: the size in bytes, at least 1.
    """
    if isinstance(value, str):
        parsed = _number_with_unit(value, _SIZE_UNITS, exponent=False)
        if parsed is None:
            raise ValueError(
                'size {!r} is not understood; give a number of bytes '
                'or a string such as "25MB" or "4MiB"'.format(value))
        value = parsed
    if not _is_number(value):
        raise ValueError('a size must be a number of bytes or a string '
                         'such as "25MB", got {!r}'.format(value))
    if not value >= 1:
        raise ValueError('a size must be at least 1 byte, got {!r}'
                         .format(value))
    return int(value)


def parse_seconds(value: Union[None, Number, str],
                  what: str) -> Optional[float]:
    """A time limit in seconds, or ``None`` for "never".

    ``None``, ``0``, a negative number, ``inf`` and strings such as
    ``'none'`` or ``'off'`` disable.

    Args:
        value: the setting (a number, a numeric string or a word).
        what (str): its name, for the error message.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if not text:
            # An empty setting is most often a variable expanded from
            # nothing (NAME=$UNSET): never read it as "off".
            raise ValueError(
                '{} is empty: give a number of seconds, 0 or "none" to '
                'disable, or leave it unset for the default'.format(what))
        if text in _DISABLED:
            return None
        try:
            number = float(text)
        except ValueError:
            number = None
    else:
        number = value
    if not _is_number(number):
        raise ValueError('{} must be a number of seconds (0 or "none" '
                         'disables), got {!r}'.format(what, value))
    value = float(number)
    if math.isnan(value):
        raise ValueError('{} must not be NaN; give a number of seconds, or '
                         '0 to disable'.format(what))
    if value <= 0 or value == float('inf'):
        return None
    return value


def parse_duration(value: Union[Number, str], what: str = 'latency') -> float:
    """A non-negative duration: seconds, or a string such as ``'25us'``.

    Units ``s``, ``ms`` and ``us``; a number without a unit is seconds.
    """
    seconds = _quantity(value, _TIME_UNITS, what, 'seconds', '"25us"',
                        's, ms or us')
    if not 0 <= seconds < float('inf'):
        raise ValueError('{} must be a finite number of seconds, at least '
                         '0, got {!r}'.format(what, value))
    return float(seconds)


def parse_delay(text: Union[None, str]) -> Optional[float]:
    """A one-way link delay such as ``'0.5ms'`` or ``'100us'``, in seconds.

    The unit (``s``, ``ms`` or ``us``) is required, so that a bare number
    is not taken for milliseconds by one reader and seconds by another.
    ``None`` means no delay.
    """
    if text is None:
        return None
    units = {k: v for k, v in _TIME_UNITS.items() if k}
    value = _number_with_unit(str(text), units)
    if value is None:
        raise ValueError('delay {!r} is not understood; give a number with '
                         'its unit, e.g. "0.5ms" or "100us"'.format(text))
    return value


def parse_rate(value: Union[Number, str], what: str = 'link rate') -> float:
    """A positive link rate in bit/s: a number, or e.g. ``'400mbit'``.

    Units ``bit``, ``kbit``, ``mbit`` and ``gbit`` (decimal, as ``tc``).
    """
    rate = _quantity(value, _RATE_UNITS, what, 'bit/s', '"400mbit"',
                     'kbit, mbit or gbit', ' or "10gbit"')
    if not 0 < rate < float('inf'):
        raise ValueError('{} must be positive and finite, got {!r}'
                         .format(what, value))
    return float(rate)


def report_line(tag: str, text: str) -> str:
    """A record for the launcher: ``tag``, the attempt's key
    (:data:`LAUNCH_KEY_ENV`) in brackets, then ``text`` (one line)."""
    return '{}[{}] {}\n'.format(tag, launch_key(), text)


def parse_flag(value: Optional[str]) -> bool:
    """A flag's setting: off for None, empty, 0, false, no and off."""
    return (value or '').strip().lower() not in _FALSE


def parse_emulation_settings(text: str) -> Dict[str, Any]:
    """Parses ``"nodes=16,bandwidth=10gbit,latency=25us"`` into a dict.

    Keys may be left out; the dict has only those given.
    """
    out: Dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(','))):
        key, sep, value = item.partition('=')
        key = key.strip()
        if not sep or key not in EMULATION_DEFAULTS:
            raise ValueError(
                '{}: cannot read {!r}; expected comma-separated key=value '
                'with keys {}'.format(EMULATION_ENV, item,
                                      ', '.join(EMULATION_DEFAULTS)))
        if key == 'nodes':
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError('{}: nodes must be a whole number, got {!r}'
                                 .format(EMULATION_ENV, value)) from None
        elif key == 'bandwidth':
            out[key] = parse_rate(value, 'bandwidth')
        else:
            out[key] = parse_duration(value, 'latency')
    return out


# ----------------------------------------------------------------------------
# Resolvers: an option, else the environment, else the default.

def resolve_timeout(option: Union[None, Number, str] = None
                    ) -> Optional[float]:
    """The watchdog timeout: the option, else the environment, else 600 s."""
    if option is None:
        env = os.environ.get(TIMEOUT_ENV)
        if env is None:
            return DEFAULT_TIMEOUT
        return parse_seconds(env, TIMEOUT_ENV)
    return parse_seconds(option, 'timeout')


def resolve_stall_warning(option: Union[None, Number, str] = None
                          ) -> Optional[float]:
    """The stall threshold: the option, else the environment, else off."""
    if option is None:
        return parse_seconds(os.environ.get(STALL_WARNING_ENV),
                             STALL_WARNING_ENV)
    return parse_seconds(option, 'stall_warning')


def resolve_debug(option: Optional[bool] = None) -> bool:
    """Whether every collective is checked: the option, else the env."""
    if option is None:
        return parse_flag(os.environ.get(DEBUG_ENV))
    return bool(option)


def resolve_emulation(nodes: Optional[int] = None,
                      bandwidth: Union[None, Number, str] = None,
                      latency: Union[None, Number, str] = None
                      ) -> Dict[str, Any]:
    """The emulated link: arguments, else the environment, else defaults.

    Returns:
        dict: ``nodes``, ``bandwidth`` and ``latency`` (the arguments as
        given; parse them with :func:`parse_rate` and
        :func:`parse_duration`).
    """
    settings = dict(EMULATION_DEFAULTS)
    settings.update(parse_emulation_settings(
        os.environ.get(EMULATION_ENV, '')))
    for key, value in (('nodes', nodes), ('bandwidth', bandwidth),
                       ('latency', latency)):
        if value is not None:
            settings[key] = value
    return settings


def resolve_native() -> bool:
    """Whether the fused C kernels may be used (on unless set to 0)."""
    value = os.environ.get(NATIVE_ENV)
    return value is None or parse_flag(value)


def resolve_abort_on_exception() -> bool:
    """Whether importing the library installs the abort hook (the env)."""
    return parse_flag(os.environ.get(ABORT_ON_EXCEPTION_ENV))


# ----------------------------------------------------------------------------
# The launcher's variables (set by ``python -m chainermn_overlap.launch``)
# and the process manager's, as its per-rank parent and the ranks read them.

def launcher_attempt() -> Optional[int]:
    """The attempt number under the restarting launcher
    (:data:`RESTART_ENV`; empty reads 0), or None when not under it."""
    value = os.environ.get(RESTART_ENV)
    return None if value is None else int(value or 0)


def progress_file() -> Optional[str]:
    """Where ``auto_snapshot`` reports its events (:data:`PROGRESS_FILE_ENV`;
    ``-``: tagged lines on standard output), or None."""
    return os.environ.get(PROGRESS_FILE_ENV) or None


def launch_deaths() -> bool:
    """Whether the per-rank parent reports an abnormal end
    (:data:`LAUNCH_DEATHS_ENV` set and not empty)."""
    return bool(os.environ.get(LAUNCH_DEATHS_ENV))


def launch_key(env: Optional[Dict[str, str]] = None) -> str:
    """The attempt's key (:data:`LAUNCH_KEY_ENV`) in ``env`` (default: this
    process's environment), or ''."""
    return (os.environ if env is None else env).get(LAUNCH_KEY_ENV, '')


def pmi_fd() -> Optional[int]:
    """The process manager's PMI socket (:data:`PMI_FD_ENV`), or None."""
    value = os.environ.get(PMI_FD_ENV, '')
    return int(value) if value.isdigit() else None


def pmi_rank() -> int:
    """The rank the process manager gave (:data:`PMI_RANK_ENV`), or -1."""
    return int(os.environ.get(PMI_RANK_ENV, -1))


def local_rank_id() -> Optional[str]:
    """The rank's number among the ranks on its host, as the process
    manager gives it (:data:`MPI_LOCALRANKID_ENV`), or None."""
    value = os.environ.get(MPI_LOCALRANKID_ENV, '')
    return value if value.isdigit() else None
