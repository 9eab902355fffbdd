"""The trained ``mini`` on the GPU in fp32 with CUDA graphs: every draft equals the dense reference's (computed
on the CPU), accepted counts equal the dense greedy prefix, and greedy output with MTP k = 1, 2, 3 equals MTP
off and the dense model's. The kernel path's twin of tests/test_mtp_fidelity.py."""

from __future__ import annotations

import pytest

from dsv4.model.loader import load_model

from .test_mtp_fidelity import (PROMPT_LENGTHS, check_drafts, dense_accepted, dense_greedy_check, failures,
                                heldout_prompt_ids, run_engine)

pytestmark = pytest.mark.cuda
CUDA = dict(device="cuda", cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4, 8]})


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompt_ids("mini", PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def reference(prompts):
    run = run_engine("mini", prompts, 0, **CUDA)
    run.model = load_model("mini")  # the dense reference on the CPU, fp32
    dense_greedy_check(run, extra=1)
    return run


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mini_drafts_and_acceptance_on_cuda_equal_the_dense_reference(prompts, reference, k):
    # (the separate graphs, whose every proposal is recorded; the whole-step graph is checked against them below)
    run = run_engine("mini", prompts, k, whole_step=False, **CUDA)
    assert run.outputs == reference.outputs
    run.model = reference.model
    c = check_drafts(run)
    assert c.checked > 0 and not failures(c), failures(c)
    seqs = dense_greedy_check(run, extra=k)
    wrong = [(v.rid, v.num_computed, v.accepted) for v in run.verifies if v.accepted != dense_accepted(seqs[v.rid], v)]
    assert not wrong, wrong[:8]
    st = run.stats
    assert st["acceptance_rate"] > 0.3 and st["num_accepted_tokens"] == sum(v.accepted for v in run.verifies)


@pytest.mark.parametrize("k", [2])
def test_mini_overlapped_mtp_equals_sync_on_cuda(prompts, reference, k):
    """The overlapped MTP step (verify launched from the previous step's device verdict, graphs replayed) against
    the synchronous one on the GPU in fp32: the same tokens and acceptance; both equal MTP off."""
    over = run_engine("mini", prompts, k, **CUDA)
    sync = run_engine("mini", prompts, k, disable_overlap_scheduler=True, **CUDA)
    assert over.outputs == sync.outputs == reference.outputs
    assert over.stats == sync.stats and over.stats["num_accepted_tokens"] > 0


def _draft_trace(trace):
    def after_step(eng, steps):
        trace.append({r: (tuple(q.drafts), len(q.output_ids)) for r, q in eng.requests.items()})
    return after_step


@pytest.mark.parametrize("k,dtype", [(1, "fp32"), (3, "fp32"), (2, "bf16")])
def test_mini_whole_step_graph_equals_separate_graphs_on_cuda(prompts, reference, k, dtype):
    """The whole-step graph (verify, greedy acceptance, the k draft passes captured as one) against the separate
    graphs with acceptance between them, on the GPU: the same tokens, the same drafts after every step and the
    same acceptance, in fp32 (both equal MTP off) and in bf16 (the same kernels on the same shapes)."""
    runs, traces = [], []
    for whole in (False, True):
        trace: list = []
        runs.append(run_engine("mini", prompts, k, whole_step=whole, after_step=_draft_trace(trace), dtype=dtype,
                               **CUDA))
        traces.append(trace)
    assert runs[0].outputs == runs[1].outputs
    if dtype == "fp32":
        assert runs[1].outputs == reference.outputs
    assert traces[0] == traces[1]
    assert runs[0].stats == runs[1].stats and runs[1].stats["num_accepted_tokens"] > 0
    assert runs[0].whole_steps == 0 and runs[1].whole_steps > 0


@pytest.mark.parametrize("k", [0, 2])
def test_mini_prefill_graphs_on_cuda_equal_eager_prefill_and_the_dense_reference(prompts, reference, k):
    """One request at a time, chunks of up to 256 tokens (the prompts of 40-470 tokens: whole, or a 256 chunk
    and the rest): every prefill chunk replays the prefill graph of the next size up (64/128/256 tokens, padded
    with inert rows), with MTP's catch-up and draft passes; in fp32 the tokens, drafts and acceptance equal
    those of eager prefill chunks, and the tokens the dense reference's."""
    runs, traces = [], []
    for sizes in ([64, 128, 256], []):
        trace: list = []
        runs.append(run_engine("mini", prompts, k, whole_step=False, after_step=_draft_trace(trace), device="cuda",
                               max_batch_size=1, max_num_tokens=256,
                               cuda_graph_config={"enable_padding": True, "batch_sizes": [1],
                                                  "prefill_token_sizes": sizes}))
        traces.append(trace)
    graphed, eager = runs
    assert graphed.prefill_replays >= len(prompts) and eager.prefill_replays == 0
    assert graphed.outputs == eager.outputs == reference.outputs
    assert traces[0] == traces[1] and graphed.stats == eager.stats
