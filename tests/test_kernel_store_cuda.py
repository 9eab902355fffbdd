"""``dsv4.kernels.store``, the cache's row store that leaves out the rows sent to the null row, against
``index_copy_``. Skipped without CUDA (run on the device machine: `pytest -m cuda`)."""

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype, vdtype, D", [(torch.bfloat16, torch.bfloat16, 512), (torch.float32, torch.float32, 96),
                                              (torch.bfloat16, torch.float32, 1536),
                                              (torch.float32, torch.float32, 2048)])  # a CSA layer's state ring
def test_store_kept_rows_leaves_the_null_row(dtype, vdtype, D):
    """The cache's row store (``kernels.store``, taken by ``CacheStorage.store``: the window ring, the entries, the
    compressor-state rings at prefill): rows sent anywhere but the null row 0 hold what index_copy_ gives them (cast
    to the cache's dtype), rows not named and the null row are untouched, with a prefill chunk's thousands of rows
    sent to the null row."""
    from dsv4.kernels.store import store_kept_rows, usable

    g = torch.Generator(device="cuda").manual_seed(D)
    R, N = 300, 5000
    data = torch.randn(R, D, device="cuda", generator=g).to(dtype)
    want = data.clone()
    rows = torch.zeros(N, dtype=torch.long, device="cuda")
    rows[-128:] = torch.randperm(R - 1, device="cuda", generator=g)[:128] + 1
    values = torch.randn(N, D, device="cuda", generator=g).to(vdtype)
    assert usable(data, rows, values)
    store_kept_rows(data, rows, values)
    want[1:].index_copy_(0, rows[-128:] - 1, values[-128:].to(dtype))
    assert torch.equal(data, want)
