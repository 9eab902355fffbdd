"""MTP's acceptance for sampled requests on the trained ``mini`` model: k = 1, 2, 3, temperatures 0.6 and 1.0
(top-p 0.95), 16 held-out prompts x 128 tokens, 8 at a time, seeded, drafting pause off. Counted, not timed
(the counts do not depend on the device): the acceptance rate and the tokens per engine step. Run it on two
commits to compare acceptance rules (``PYTHONPATH=<other checkout>``)."""

from __future__ import annotations

import argparse

from common import report, table

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--label", default="", help="what this run's code is (the table's first column)")
    ap.add_argument("--append", default=None)
    a = ap.parse_args()
    prompts = heldout_prompts("mini")[:16]
    rows = []
    for k in a.ks:
        llm = LLM("mini", device=a.device, max_batch_size=8, max_num_tokens=2048, max_seq_len=1024,
                  speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k,
                                      "pause_below_acceptance": 0})
        for T in a.temperatures:
            llm.engine.reset_stats()
            toks = 0
            for i in range(0, len(prompts), 8):
                sp = [SamplingParams(max_tokens=128, ignore_eos=True, temperature=T, top_p=0.95, seed=100 + i + j)
                      for j in range(8)]
                toks += sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts[i:i + 8], sp))
            st = llm.get_stats()["speculative"]
            rows.append([a.label, k, T, f"{st['acceptance_rate']:.3f}", f"{toks / llm.engine.num_steps:.3f}"])
            print(rows[-1], flush=True)
        del llm
    report("MTP acceptance of sampled requests on mini (16 held-out prompts x 128 tokens, 8 at a time, top-p 0.95)",
           table(["code", "k", "temperature", "acceptance", "tokens / step"], rows), a.append)


if __name__ == "__main__":
    main()
