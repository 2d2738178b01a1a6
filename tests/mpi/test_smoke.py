import chainermn
import numpy as np


def test_allreduce_smoke():
    comm = chainermn.create_communicator('naive')
    x = np.full(3, comm.rank, dtype=np.float32)
    y = comm.allreduce(x)
    np.testing.assert_array_equal(y, np.full(3, sum(range(comm.size))))
