"""The seed's matrix at its own scale, tp4/ep4 (MTP on/off x attention DP on/off), with 4 gloo ranks on the
CPU: greedy output token-identical to one process. (The seed ran tp4/ep4 on 4 GPUs; that run needs the
nvidia-h200-x4 kind, issue 8.) fp64 so that summing partial results across 4 ranks cannot flip a choice."""

import random

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.io import write_checkpoint
from dsv4.config import get_preset

KW = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=128, kv_cache_config={"max_tokens": 2048}, dtype="fp64")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # tiny with one head per output group, so heads split 4 ways; 8 experts split 4 ways
    cfg = get_preset("tiny").replace(o_groups=4, o_lora_rank=16)
    d = str(tmp_path_factory.mktemp("g4"))
    write_checkpoint(d, cfg, random_state_dict(cfg, seed=4))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(L)] for L in (3, 40, 90)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(d, **KW).generate(prompts, sp)]
    return d, prompts, sp, ref


@pytest.mark.parametrize("adp", [False, True], ids=["adp-off", "adp-on"])
@pytest.mark.parametrize("k", [0, 1], ids=["mtp-off", "mtp-on"])
def test_seed_matrix_tp4_ep4_on_cpu(setup, adp, k):
    d, prompts, sp, ref = setup
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None
    with LLM(d, tensor_parallel_size=4, moe_expert_parallel_size=4, enable_attention_dp=adp,
             speculative_config=spec, **KW) as llm:
        assert llm.get_stats()["parallel"]["world_size"] == 4
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert out == ref
