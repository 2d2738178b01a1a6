"""``chainermn_overlap.config``: option parsers, resolvers, the environment.

Every parser is tested with good input and with each kind of bad input; an
error must name the option and say what to give instead.
"""
import ast
import os
import re

import numpy as np
import pytest

from chainermn_overlap import _host
from chainermn_overlap import config

PACKAGE = os.path.dirname(os.path.abspath(config.__file__))


@pytest.fixture
def clean_env(monkeypatch):
    for name in config.ENVIRONMENT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---------------------------------------------------------------------------
# Sizes

@pytest.mark.parametrize('value, expected', [
    (1, 1), (1024, 1024), (4096.7, 4096), ('7', 7), ('25MB', 25 * 10 ** 6),
    ('4MiB', 4 * 2 ** 20), (' 1.5 kb ', 1500), ('2GiB', 2 * 2 ** 30),
    ('16b', 16), ('3 Gb', 3 * 10 ** 9)])
def test_parse_size(value, expected):
    assert config.parse_size(value) == expected


@pytest.mark.parametrize('value', ['lots', '25 MBs', '1e3', '-5MB', ''])
def test_parse_size_rejects_unknown_text(value):
    with pytest.raises(ValueError) as e:
        config.parse_size(value)
    msg = str(e.value)
    assert repr(value) in msg and 'not understood' in msg, msg
    assert '"25MB" or "4MiB"' in msg, msg


@pytest.mark.parametrize('value', [None, True, [1], b'1MB'])
def test_parse_size_rejects_other_types(value):
    with pytest.raises(ValueError, match='a size must be a number of bytes '
                       'or a string such as "25MB", got'):
        config.parse_size(value)


@pytest.mark.parametrize('value', [0, 0.5, -3, '0MB', float('nan')])
def test_parse_size_rejects_less_than_a_byte(value):
    with pytest.raises(ValueError, match='at least 1 byte'):
        config.parse_size(value)


# ---------------------------------------------------------------------------
# Time limits (0 or "none" disable)

@pytest.mark.parametrize('value, expected', [
    (None, None), (0, None), (-1, None), (float('inf'), None),
    ('none', None), ('Off', None), (' never ', None),
    ('0', None), ('inf', None), (3, 3.0), ('2.5', 2.5), (' 7 ', 7.0)])
def test_parse_seconds(value, expected):
    assert config.parse_seconds(value, 'timeout') == expected


@pytest.mark.parametrize('value', ['soon', [1], True, '3 minutes'])
def test_parse_seconds_rejects(value):
    with pytest.raises(ValueError) as e:
        config.parse_seconds(value, 'stall_warning')
    assert str(e.value) == (
        'stall_warning must be a number of seconds (0 or "none" disables), '
        'got {!r}'.format(value))


@pytest.mark.parametrize('value', [float('nan'), 'nan'])
def test_parse_seconds_rejects_nan(value):
    with pytest.raises(ValueError, match='timeout must not be NaN; give a '
                       'number of seconds, or 0 to disable'):
        config.parse_seconds(value, 'timeout')


# ---------------------------------------------------------------------------
# Durations with units (latency) and link delays

@pytest.mark.parametrize('value, expected', [
    (0, 0.0), (0.001, 0.001), ('0', 0.0), ('25us', 25e-6),
    ('1.5ms', 1.5e-3), ('2s', 2.0), ('3 US', 3e-6), ('1e-3', 1e-3),
    ('2.5e-05', 2.5e-5)])
def test_parse_duration(value, expected):
    assert config.parse_duration(value) == pytest.approx(expected, rel=1e-12)


def test_parse_duration_rejects_unknown_text():
    with pytest.raises(ValueError) as e:
        config.parse_duration('a while', 'latency')
    assert str(e.value) == ("latency 'a while' is not understood; give "
                            'seconds or a number with s, ms or us, e.g. '
                            '"25us"')


@pytest.mark.parametrize('value', [-1, -1e-9, float('inf'), float('nan')])
def test_parse_duration_rejects_negative_and_infinite(value):
    with pytest.raises(ValueError, match='latency must be a finite number '
                       'of seconds, at least 0'):
        config.parse_duration(value)


@pytest.mark.parametrize('value', [None, True, [1]])
def test_parse_duration_rejects_other_types(value):
    with pytest.raises(ValueError, match='must be seconds or a string such '
                       'as "25us"'):
        config.parse_duration(value)


@pytest.mark.parametrize('value, expected', [
    (None, None), ('0.5ms', 5e-4), ('100us', 1e-4), ('2s', 2.0),
    (' 0.2 MS ', 2e-4)])
def test_parse_delay(value, expected):
    got = config.parse_delay(value)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize('value', ['5 parsecs', '0.5', 0.5, 'ms'])
def test_parse_delay_needs_a_unit(value):
    # A bare number is refused: tc reads it as microseconds, people as
    # milliseconds or seconds.
    with pytest.raises(ValueError) as e:
        config.parse_delay(value)
    msg = str(e.value)
    assert msg.startswith('delay {!r} is not understood'.format(value)), msg
    assert 'with its unit, e.g. "0.5ms" or "100us"' in msg, msg


# ---------------------------------------------------------------------------
# Link rates

@pytest.mark.parametrize('value, expected', [
    ('400mbit', 400e6), ('1.5gbit', 1.5e9), ('10Gbit', 10e9), (2e8, 2e8),
    (8000, 8000.0), ('8000', 8000.0), ('64kbit', 64e3), ('1e9', 1e9),
    ('100 bit', 100.0)])
def test_parse_rate(value, expected):
    got = config.parse_rate(value)
    assert got == expected and isinstance(got, float)


def test_parse_rate_rejects_unknown_text():
    with pytest.raises(ValueError) as e:
        config.parse_rate('fast')
    assert str(e.value) == (
        "link rate 'fast' is not understood; give bit/s or a number with "
        'kbit, mbit or gbit, e.g. "400mbit" or "10gbit"')


@pytest.mark.parametrize('value', ['0mbit', 0, -5, '1e999', float('nan')])
def test_parse_rate_rejects_zero_negative_and_infinite(value):
    with pytest.raises(ValueError) as e:
        config.parse_rate(value, 'bandwidth')
    assert str(e.value) == ('bandwidth must be positive and finite, got '
                            '{!r}'.format(value))


@pytest.mark.parametrize('value', [None, True, ['1gbit']])
def test_parse_rate_rejects_other_types(value):
    with pytest.raises(ValueError, match='link rate must be bit/s or a '
                       'string such as "400mbit"'):
        config.parse_rate(value)


# ---------------------------------------------------------------------------
# Flags and the emulation settings

@pytest.mark.parametrize('value, expected', [
    (None, False), ('', False), ('0', False), ('off', False),
    ('False', False), (' no ', False), ('1', True), ('yes', True),
    (' ON ', True), ('true', True)])
def test_parse_flag(value, expected):
    assert config.parse_flag(value) is expected


def test_parse_emulation_settings():
    got = config.parse_emulation_settings(
        'nodes=8, bandwidth=1gbit,latency=10us')
    assert got == {'nodes': 8, 'bandwidth': 1e9,
                   'latency': pytest.approx(1e-5)}
    assert config.parse_emulation_settings('') == {}
    assert config.parse_emulation_settings('nodes=4,') == {'nodes': 4}


@pytest.mark.parametrize('text, expected', [
    ('speed=3', "CHAINERMN_OVERLAP_EMULATION: cannot read 'speed=3'; "
                'expected comma-separated key=value with keys nodes, '
                'bandwidth, latency'),
    ('nodes', "CHAINERMN_OVERLAP_EMULATION: cannot read 'nodes'"),
    ('nodes=many', "CHAINERMN_OVERLAP_EMULATION: nodes must be a whole "
                   "number, got 'many'"),
    ('bandwidth=fast', "bandwidth 'fast' is not understood"),
    ('latency=soon', "latency 'soon' is not understood")])
def test_parse_emulation_settings_rejects(text, expected):
    with pytest.raises(ValueError) as e:
        config.parse_emulation_settings(text)
    assert str(e.value).startswith(expected), str(e.value)


# ---------------------------------------------------------------------------
# Resolvers: option, else environment, else default

def test_resolve_timeout(clean_env):
    assert config.resolve_timeout(None) == config.DEFAULT_TIMEOUT == 600.0
    clean_env.setenv(config.TIMEOUT_ENV, '0')
    assert config.resolve_timeout(None) is None
    clean_env.setenv(config.TIMEOUT_ENV, '12')
    assert config.resolve_timeout(None) == 12.0
    assert config.resolve_timeout(5) == 5.0  # the option wins
    assert config.resolve_timeout('none') is None


@pytest.mark.parametrize('value', ['', '  '])
def test_an_empty_time_limit_is_an_error_not_off(clean_env, value):
    # CHAINERMN_OVERLAP_TIMEOUT=$UNSET used to turn the watchdog off.
    clean_env.setenv(config.TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match='^CHAINERMN_OVERLAP_TIMEOUT is '
                       'empty: give a number of seconds, 0 or "none" to '
                       'disable, or leave it unset for the default$'):
        config.resolve_timeout(None)
    with pytest.raises(ValueError, match='^timeout is empty'):
        config.resolve_timeout(value)


def test_resolve_timeout_names_the_bad_setting(clean_env):
    clean_env.setenv(config.TIMEOUT_ENV, 'soon')
    with pytest.raises(ValueError, match='^CHAINERMN_OVERLAP_TIMEOUT must '
                       'be a number of seconds'):
        config.resolve_timeout(None)
    with pytest.raises(ValueError, match='^timeout must be a number'):
        config.resolve_timeout('later')


@pytest.mark.parametrize('option, env, expected', [
    (None, None, None), (None, '30', 30.0), (2, '30', 2.0),
    ('off', '30', None), (None, 'none', None), ('1.5', None, 1.5)])
def test_resolve_stall_warning(clean_env, option, env, expected):
    # Off unless asked for; the option wins over the environment.
    if env is not None:
        clean_env.setenv(config.STALL_WARNING_ENV, env)
    assert config.resolve_stall_warning(option) == expected


def test_resolve_stall_warning_names_the_bad_setting(clean_env):
    clean_env.setenv(config.STALL_WARNING_ENV, 'soon')
    with pytest.raises(ValueError, match='^CHAINERMN_OVERLAP_STALL_WARNING '
                       'must be a number'):
        config.resolve_stall_warning(None)
    with pytest.raises(ValueError, match='^stall_warning must be a number'):
        config.resolve_stall_warning([1])


def test_resolve_debug(clean_env):
    assert config.resolve_debug(None) is False
    clean_env.setenv(config.DEBUG_ENV, '1')
    assert config.resolve_debug(None) is True
    assert config.resolve_debug(False) is False  # the option wins
    clean_env.setenv(config.DEBUG_ENV, 'off')
    assert config.resolve_debug(None) is False
    assert config.resolve_debug(1) is True


def test_resolve_emulation(clean_env):
    assert config.resolve_emulation() == config.EMULATION_DEFAULTS
    clean_env.setenv(config.EMULATION_ENV, 'nodes=4,latency=1ms')
    assert config.resolve_emulation() == {
        'nodes': 4, 'bandwidth': 10e9, 'latency': pytest.approx(1e-3)}
    # Arguments win over the environment, key by key.
    assert config.resolve_emulation(bandwidth='1gbit') == {
        'nodes': 4, 'bandwidth': '1gbit', 'latency': pytest.approx(1e-3)}
    clean_env.setenv(config.EMULATION_ENV, 'speed=fast')
    with pytest.raises(ValueError, match='CHAINERMN_OVERLAP_EMULATION'):
        config.resolve_emulation()


def test_resolve_abort_on_exception(clean_env):
    assert config.resolve_abort_on_exception() is False
    clean_env.setenv(config.ABORT_ON_EXCEPTION_ENV, '1')
    assert config.resolve_abort_on_exception() is True
    clean_env.setenv(config.ABORT_ON_EXCEPTION_ENV, 'no')
    assert config.resolve_abort_on_exception() is False


# ---------------------------------------------------------------------------
# The environment variables: all here, all documented

def _library_sources():
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield path, f.read()


def test_every_environment_variable_is_defined_and_documented():
    names = set(config.ENVIRONMENT_VARIABLES)
    assert len(names) == len(config.ENVIRONMENT_VARIABLES)
    for name in names:
        assert name.startswith('CHAINERMN_OVERLAP_')
        # Documented: in the module docstring with its constant.
        assert '``{}``'.format(name) in config.__doc__, name
    constants = {getattr(config, c) for c in config.__all__
                 if c.endswith('_ENV') or c.endswith('_ENVS')}
    foreign = set(config.FOREIGN_VARIABLES)
    assert not foreign & names
    for name in foreign:
        # Others' variables (process manager, batch schedulers): documented.
        assert '``{}``'.format(name) in config.__doc__, name
    assert {n for c in constants
            for n in (c if isinstance(c, tuple) else (c,))} == names | foreign
    # The library spells no variable that config does not define.
    spelled = set()
    for _, text in _library_sources():
        spelled.update(re.findall(r'CHAINERMN_OVERLAP_[A-Z_]*[A-Z]', text))
    assert spelled <= names, spelled - names


def _dotted(node):
    """``'os.environ.get'`` for that attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return '.'.join([node.id] + parts[::-1])
    return None


def _environment_uses(source):
    """``(line, what)`` of each place ``source`` reads the environment or
    spells a variable's name (docstrings aside)."""
    tree = ast.parse(source)
    names = set(config.ENVIRONMENT_VARIABLES) | set(config.FOREIGN_VARIABLES)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, 'body', None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)):
            docstrings.add(id(body[0].value))
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call)
                and _dotted(node.func) in ('os.getenv', 'os.environ.get')):
            out.append((node.lineno, _dotted(node.func)))
        elif (isinstance(node, ast.Subscript)
                and _dotted(node.value) == 'os.environ'
                and isinstance(node.ctx, ast.Load)):
            out.append((node.lineno, 'os.environ[...]'))
        elif (isinstance(node, ast.Compare)
                and any(_dotted(c) == 'os.environ'
                        for c in node.comparators)):
            out.append((node.lineno, '... in os.environ'))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings
                and (node.value in names or re.fullmatch(
                    r'CHAINERMN_OVERLAP_[A-Z0-9_]+', node.value))):
            out.append((node.lineno, repr(node.value)))
    return sorted(out)


def test_the_environment_check_sees_reads_and_names():
    # The check below finds what it looks for (and no docstring).
    source = (
        '"""Reads CHAINERMN_OVERLAP_TIMEOUT."""\n'
        'import os\n'
        "A = os.environ.get('CHAINERMN_OVERLAP_TIMEOUT')\n"
        "B = os.getenv('HOME')\n"
        "C = os.environ['PMI_RANK']\n"
        "D = 'CHAINERMN_OVERLAP_NEW' in os.environ\n"
        "os.environ[config.PMI_FD_ENV] = '3'\n"
        'E = dict(os.environ)\n')
    assert _environment_uses(source) == [
        (3, "'CHAINERMN_OVERLAP_TIMEOUT'"), (3, 'os.environ.get'),
        (4, 'os.getenv'), (5, "'PMI_RANK'"), (5, 'os.environ[...]'),
        (6, "'CHAINERMN_OVERLAP_NEW'"), (6, '... in os.environ')]


def test_the_environment_is_named_and_read_in_config_only():
    # Anywhere else, a variable is read through config's functions and
    # named by config's constants (writing one for a child process, or
    # copying the whole environment, is fine).
    found = {}
    for path, text in _library_sources():
        if os.path.samefile(path, config.__file__):
            continue
        uses = _environment_uses(text)
        if uses:
            found[os.path.relpath(path, PACKAGE)] = uses
    assert found == {}


def test_public_names_are_listed():
    for name in config.__all__:
        assert hasattr(config, name), name


# ---------------------------------------------------------------------------
# Host staging (chainermn_overlap._host), shared by engines and distconv

def test_to_host_keeps_contiguous_numpy_arrays():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert _host.to_host(a) is a
    assert _host.is_host(a)


def test_to_host_copies_strided_arrays_contiguous():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    host = _host.to_host(a)
    assert host.flags.c_contiguous and host is not a
    np.testing.assert_array_equal(host, a)


def test_stage_to_host_reduces_numpy_arrays_in_place():
    a = np.arange(4, dtype=np.float32)
    host, finish = _host.stage_to_host(a)
    assert host is a and finish is None

