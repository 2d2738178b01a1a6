"""``shard=ShardOptions(...)`` and the ``shard_*`` keywords, without MPI.

Both spellings resolve to the same settings; giving both is an error that
names the keywords; a bad value is refused when the object is made.  (The
settings at work, through the optimizer: ``tests/mpi/test_sharding.py``.)
"""
import pytest

import chainermn_overlap
from chainermn_overlap import ShardOptions
from chainermn_overlap.optimizers.sharding import options

KEYWORDS = ('unit', 'update', 'in_flight', 'prefetch')


def _resolve(shard, **keywords):
    args = [keywords.get('shard_' + k, options.DEFAULTS[k]) for k in KEYWORDS]
    return options.resolve(shard, *args, compression=None, backend=None)


@pytest.mark.parametrize('mode, fields', [
    ('optimizer', {}),
    ('optimizer', {'unit': 'parameter', 'update': 'backward'}),
    ('gradients', {'in_flight': '32MB', 'unit': 'element'}),
    ('gradients', {'in_flight': None}),
    ('parameters', {'prefetch': 0, 'in_flight': 1024}),
    ('parameters', {'prefetch': '64MiB', 'update': 'backward'}),
    ('parameters', {'prefetch': None}),
])
def test_the_object_resolves_as_the_keywords(mode, fields):
    keywords = {'shard_' + k: v for k, v in fields.items()}
    got = _resolve(ShardOptions(mode, **fields))
    assert got == _resolve(mode, **keywords)
    assert got.mode == mode
    # The keywords given are not the defaults: the settings differ from
    # the mode alone wherever a field was given (the comparison can fail).
    plain = _resolve(mode)
    for k in fields:
        assert getattr(got, k) != getattr(plain, k), k


def test_the_defaults_show_as_their_values():
    # Signatures and docs show the keywords' defaults as before.
    import inspect
    sig = inspect.signature(chainermn_overlap.create_overlapped_optimizer)
    shown = {k: repr(sig.parameters['shard_' + k].default) for k in KEYWORDS}
    assert shown == {'unit': "'auto'", 'update': "'update'",
                     'in_flight': "'auto'", 'prefetch': "'auto'"}
    # Given explicitly, a default value is a keyword given.
    with pytest.raises(ValueError, match='shard_unit'):
        _resolve(ShardOptions('optimizer'), shard_unit='auto')


def test_both_spellings_at_once_is_an_error_naming_the_keywords():
    with pytest.raises(ValueError) as e:
        _resolve(ShardOptions('parameters', prefetch=0),
                 shard_prefetch='1MB', shard_update='backward')
    text = str(e.value)
    assert "shard_prefetch='1MB'" in text and "shard_update='backward'" in text
    # ... and says where they go instead.
    assert 'prefetch=...' in text and 'update=...' in text


@pytest.mark.parametrize('make, match', [
    (lambda: ShardOptions(None), 'needs a mode'),
    (lambda: ShardOptions('zero'), "'optimizer', 'gradients' or"),
    (lambda: ShardOptions('optimizer', unit='row'), 'shard_unit'),
    (lambda: ShardOptions('optimizer', update='later'), 'shard_update'),
    (lambda: ShardOptions('optimizer', in_flight='1MB'), 'shard_in_flight'),
    (lambda: ShardOptions('gradients', prefetch='1MB'), 'shard_prefetch'),
    (lambda: ShardOptions('parameters', prefetch='lots'), 'shard_prefetch'),
])
def test_bad_options_are_refused_when_made(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_the_object_compares_and_shows_its_fields():
    a = ShardOptions('parameters', prefetch='64MB')
    assert a == ShardOptions('parameters', prefetch='64MB')
    assert a != ShardOptions('parameters')
    assert len({a, ShardOptions('parameters', prefetch='64MB')}) == 1
    assert repr(a) == ("ShardOptions(mode='parameters', unit='auto', "
                       "update='update', in_flight='auto', prefetch='64MB')")


def test_sharding_checks_apply_to_the_object():
    # Combinations with other options are checked as for the string.
    with pytest.raises(ValueError, match='compression'):
        options.resolve(ShardOptions('optimizer'),
                        *[options.DEFAULTS[k] for k in KEYWORDS],
                        compression=object(), backend=None)
