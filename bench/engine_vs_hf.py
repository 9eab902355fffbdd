"""dsv4 vs transformers' DeepseekV4ForCausalLM.generate on the same random weights (greedy, same prompts):
output tok/s of both and the ratio, at several concurrencies, measured in one run."""

from __future__ import annotations

import argparse
import random
import warnings

import torch

from common import report, table, timed

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.names import model_to_hf
from dsv4.config import get_preset


def hf_model(cfg, sd, dtype):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_cfg = DeepseekV4Config(**cfg.to_hf_dict())
        hf_cfg._attn_implementation = "eager"
        with torch.device("cuda"):
            hf = DeepseekV4ForCausalLM._from_config(hf_cfg, torch_dtype=dtype).eval()
    hf.load_state_dict({k: v for k, v in model_to_hf(sd).items() if not k.startswith("mtp.")}, strict=False)
    return hf


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--append", default=None, help="markdown file to append the result to")
    args = ap.parse_args()
    dtype = torch.bfloat16
    cfg = get_preset(args.preset)
    llm = LLM(args.preset, device="cuda", dtype="bf16", seed=args.seed, max_batch_size=max(args.concurrency),
              max_num_tokens=4096, max_seq_len=args.prompt_len + args.gen + 8,
              kv_cache_config={"free_gpu_memory_fraction": 0.2})
    sd = random_state_dict(cfg, seed=args.seed, dtype=dtype, device="cuda")  # the same weights as llm's
    hf = hf_model(cfg, sd, dtype)
    del sd
    rng = random.Random(args.seed)
    rows = []
    for c in args.concurrency:
        prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(c)]
        ids = torch.tensor(prompts, device="cuda")

        def run_hf(n=args.gen):
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        def run_ours(n=args.gen):
            return llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

        run_hf(4), run_ours(4)  # warm up both
        t_hf, out_hf = timed(run_hf)
        t_ours, out_ours = timed(run_ours)
        ref = out_hf[:, args.prompt_len:].tolist()
        ours = [o.outputs[0].token_ids for o in out_ours]
        same = sum(a == b for r, o in zip(ref, ours) for a, b in zip(r, o)) / (c * args.gen)
        first = min((next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), args.gen)
                     for r, o in zip(ref, ours)))
        rows.append([c, c * args.gen / t_hf, c * args.gen / t_ours, (t_hf / t_ours), f"{same:.3f}", first])
    text = table(["concurrency", "transformers tok/s", "dsv4 tok/s", "dsv4 / transformers",
                  "greedy tokens identical", "first divergence (token)"], rows)
    report(f"dsv4 vs transformers generate, {args.preset}, bf16, {args.prompt_len}-token prompts, "
           f"{args.gen} output tokens", text, args.append,
           notes="Random weights; transformers clamps the shared expert (dsv4 follows DeepSeek's code and does"
                 " not), so a divergence can also come from that, besides bf16 near-ties.")


if __name__ == "__main__":
    main()
