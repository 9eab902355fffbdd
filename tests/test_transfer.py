"""dsv4.transfer.to_device on the CPU: host ints of every form the engine passes arrive as the int64 tensor
torch.tensor makes of them (its twin)."""

import numpy as np
import pytest
import torch

from dsv4.transfer import to_device


@pytest.mark.parametrize("values", [[], [7], [3, 0, -1, 2 ** 40], (5, 6), range(4, 9), [True, False, 3],
                                    list(range(8192))])
def test_host_ints_arrive_as_torch_tensor_makes_them(values):
    got = to_device(values, "cpu")
    want = torch.tensor(list(values), dtype=torch.long)
    assert got.dtype == torch.long and torch.equal(got, want)


def test_an_int64_array_and_other_dtypes():
    arr = np.arange(5, dtype=np.int64)
    assert torch.equal(to_device(arr, "cpu"), torch.arange(5))
    got = to_device([1, 0, 1], "cpu", dtype=torch.int32)
    assert got.dtype == torch.int32 and got.tolist() == [1, 0, 1]
