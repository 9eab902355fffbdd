"""CacheStorage tensors, fp8 rows, the reference gather/scatter ops, and budget sizing."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.cache import (CacheConfigError, CacheLayout, CacheStorage, budget_from_fraction, dequantize_fp8,
                        gather_combined, quantize_fp8, scatter_rows, size_cache)
from dsv4.config import get_preset


def layout(max_draft_len=2, tpb=16, preset="tiny"):
    return CacheLayout(get_preset(preset), max_draft_len, tpb)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp32", "fp8"])
def test_shapes_zero_init_and_byte_accounting(kv_dtype):
    lay = layout()
    st = CacheStorage(lay, num_slots=3, num_blocks=5, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    D, dI, S = 32, 16, lay.swa_cap
    assert len(st.swa) == lay.num_swa_layers == 5 and all(t.shape == (4 * S, D) for t in st.swa)
    assert st.state[1].shape == (4 * lay.state_cap(4), 2 * 2 * D) and st.state[1].dtype == torch.float32
    assert st.state[2].shape == (4 * lay.state_cap(16), 2 * 1 * D)
    assert st.index_state[3].shape == (4 * lay.state_cap(4), 4 * dI) and set(st.index_state) == {1, 3}
    assert st.entries[1].shape == (6 * 4, D) and st.entries[2].shape == (6 * 1, D)
    assert st.index_keys[1].shape == (6 * 4, dI) and st.index_keys[1].dtype == torch.bfloat16
    if kv_dtype == "fp8":
        assert st.swa[0].dtype == torch.float8_e4m3fn and st.swa_scale[0].shape == (4 * S, 1)
    for t in st.tensors():                                   # every row, null rows included, starts at zero
        assert not t.float().any()
    expect = 4 * CacheStorage.bytes_per_slot(lay, torch.bfloat16, kv_dtype) + \
        6 * CacheStorage.bytes_per_block(lay, torch.bfloat16, kv_dtype)
    assert st.nbytes() == expect
    assert st.bytes_per_slot() == CacheStorage.bytes_per_slot(lay, torch.bfloat16, kv_dtype)
    with pytest.raises(CacheConfigError, match="kv_dtype"):
        CacheStorage(lay, 1, 1, kv_dtype="int4")


def test_fp8_round_trip_within_tolerance():
    lay = CacheLayout(get_preset("flash-L3-E8"), 1, 128)           # D = 512: 8 scale blocks per row
    torch.manual_seed(0)
    st = CacheStorage(lay, num_slots=2, num_blocks=2, dtype=torch.bfloat16, kv_dtype="fp8")
    x = torch.randn(5, 512) * torch.logspace(-3, 2, 5)[:, None]    # rows of very different magnitude
    x[:, 448:] *= 10                                               # and blocks of different magnitude
    rows = torch.tensor([3, 7, 130, 9, 200])
    st.write_swa(0, rows, x)
    back = st.read_swa(0, rows).float()
    assert back.dtype == torch.float32 and back.shape == x.shape
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 per value against the block's amax scale
    blocks = x.view(5, 8, 64).abs().amax(-1).repeat_interleave(64, 1)
    assert ((back - x).abs() <= blocks * 2.0 ** -4 + 1e-6).all()
    assert torch.allclose(back, x, rtol=0.07, atol=blocks.min().item() * 0.07)
    assert not st.read_swa(0, torch.tensor([0, 1, 4])).any()       # untouched rows still read zero
    ent = torch.randn(2, 512)
    st.write_entries(1, torch.tensor([5, 1]), ent)
    assert torch.allclose(st.read_entries(1, torch.tensor([5, 1])).float(), ent, rtol=0.07, atol=0.02)
    q, s = quantize_fp8(torch.zeros(1, 40))                        # width not a multiple of 64, all zeros
    assert q.shape == (1, 40) and s.shape == (1, 1) and not dequantize_fp8(q, s, torch.float32).any()


def test_gather_combined_and_scatter_rows():
    store = torch.arange(12, dtype=torch.float32).view(6, 2)
    step = torch.tensor([[100.0, 101.0], [200.0, 201.0]])
    index = torch.tensor([[0, 5, 6], [7, 2, 3]])
    valid = torch.tensor([[False, True, True], [True, True, False]])
    got = gather_combined(store, step, index, valid)
    assert got.tolist() == [[[0, 0], [10, 11], [100, 101]], [[200, 201], [4, 5], [0, 0]]]
    assert gather_combined(store, step[:0], index[:, :2].clamp(max=5), valid[:, :2]).shape == (2, 2, 2)
    scatter_rows(store, torch.tensor([1, 0, 0]), torch.tensor([[7.0, 7.0], [8.0, 8.0], [9.0, 9.0]]))
    assert store[1].tolist() == [7, 7] and store[2].tolist() == [4, 5]


def test_swa_gather_through_storage_reads_fp8_rows():
    lay = layout()
    st = CacheStorage(lay, num_slots=1, num_blocks=1, dtype=torch.float32, kv_dtype="fp8")
    st.write_swa(4, torch.tensor([lay.swa_cap + 2]), torch.full((1, 32), 3.0))
    R = st.swa[4].shape[0]
    got = st.gather_swa(4, torch.full((1, 32), 5.0), torch.tensor([[lay.swa_cap + 2, R, 0]]),
                        torch.tensor([[True, True, False]]))
    assert got[0, 0].eq(3).all() and got[0, 1].eq(5).all() and not got[0, 2].any()


# ---- sizing ---------------------------------------------------------------------------------------------
def test_size_cache_splits_budget_and_caps():
    lay = layout(max_draft_len=2, tpb=16)
    bps = CacheStorage.bytes_per_slot(lay, torch.bfloat16, "auto")
    bpb = CacheStorage.bytes_per_block(lay, torch.bfloat16, "auto")
    per_seq = math.ceil((100 + 2) / 16)
    # plenty of memory: max_batch_size slots, blocks capped at what they can use
    s = size_cache(lay, torch.bfloat16, "auto", 1 << 30, max_batch_size=4, max_seq_len=100)
    assert (s.num_slots, s.num_blocks, s.capped) == (4, 4 * per_seq, True)
    assert s.total_bytes == 5 * bps + (4 * per_seq + 1) * bpb <= s.budget_bytes
    # tight: fewer slots than max_batch_size, the rest blocks, always room for one full sequence
    null = bps + bpb
    budget = null + 2 * bps + per_seq * bpb + 3 * bpb
    s = size_cache(lay, torch.bfloat16, "auto", budget, max_batch_size=8, max_seq_len=100)
    assert s.num_slots == 2 and s.num_blocks == per_seq + 3 and not s.capped
    assert s.total_bytes == budget
    text = s.describe()
    assert "2 slots" in text and f"{per_seq + 3} blocks" in text and "KiB/token" in text and "KiB budget" in text and "0.0 MiB" not in text
    # one slot's blocks are capped at one sequence
    s = size_cache(lay, torch.bfloat16, "auto", null + bps + (per_seq + 5) * bpb, max_batch_size=8,
                   max_seq_len=100)
    assert (s.num_slots, s.num_blocks, s.capped) == (1, per_seq, True)
    with pytest.raises(CacheConfigError, match="cannot hold one sequence of max_seq_len=100"):
        size_cache(lay, torch.bfloat16, "auto", null + bps + per_seq * bpb - 1, max_batch_size=8, max_seq_len=100)


def test_flash_split_is_reported():
    lay = CacheLayout(get_preset("flash"), 3, 256)
    s = size_cache(lay, torch.bfloat16, "fp8", 40 << 30, max_batch_size=64, max_seq_len=32768)
    assert s.num_slots == 64 and s.total_bytes <= 40 << 30
    # growing state per token: 21 CSA x (one fp8 row of 512 + 8 fp32 scales, and one bf16 128-key, per 4
    # tokens) + 20 HCA x one fp8 row per 128 tokens
    per_tok = 21 * ((512 + 32) / 4 + 128 * 2 / 4) + 20 * (512 + 32) / 128
    assert s.bytes_per_block / 256 == per_tok
    assert "per request" in s.describe()


def test_budget_from_fraction_cpu():
    b = budget_from_fraction(0.5, "cpu")
    assert b > 0 and budget_from_fraction(1.0, "cpu") >= b
    with pytest.raises(CacheConfigError):
        budget_from_fraction(0.0, "cpu")
