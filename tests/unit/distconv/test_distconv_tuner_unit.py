"""Pure helpers of the distconv tuner (no MPI)."""
from chainermn_overlap.distconv import tuner


def test_candidate_grids_divide_size():
    assert tuner.candidate_grids(1, 2) == [(1, 1)]
    assert tuner.candidate_grids(2, 2) == [(1, 1), (1, 2), (2, 1)]
    for shape in tuner.candidate_grids(12, 3):
        assert 12 % (shape[0] * shape[1] * shape[2]) == 0


def test_invalid_reason():
    assert tuner._invalid_reason((2, 1), 4, 2) is None
    assert 'divide' in tuner._invalid_reason((3, 1), 4, 2)
    assert 'dimensions' in tuner._invalid_reason((1, 1, 1), 4, 2)


def test_format_table_marks_choice():
    result = {'best': (2, 1), 'best_index': 1, 'best_median_s': 0.5,
              'iterations': 3,
              'table': [{'candidate': (1, 1), 'status': 'ok',
                         'median_s': 0.7, 'reason': None},
                        {'candidate': (2, 1), 'status': 'ok',
                         'median_s': 0.5, 'reason': None},
                        {'candidate': (3, 1), 'status': 'invalid',
                         'median_s': None, 'reason': 'does not divide'}]}
    text = tuner.format_table(result)
    assert 'chosen: [2, 1]' in text
    assert text.splitlines()[2].startswith('*')
