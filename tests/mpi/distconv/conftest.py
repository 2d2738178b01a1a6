import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _same_random_state_on_every_rank():
    # Chainer's default initialisers draw from numpy's global state; the
    # serial reference and the distributed model must agree on every rank.
    np.random.seed(1234)
    yield
