"""What the drafting pause (``engine/spec_pause.py``) costs a model whose drafts do pay: the trained ``mini`` with
MTP k = 1, 2, 3 at concurrency 1 and 8 on its held-out prompts (128 new tokens each, EOS ignored, greedy),
without the pause and with it (threshold 0.3, windows of 32 and 64 drafts). Counted, not timed: tokens emitted
per engine step, the acceptance, and the pauses, resumes and paused steps the policy took. The counts do not
depend on the device (fp32 on the CPU by default)."""

from __future__ import annotations

import argparse

from common import report, table

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts
from dsv4.engine.spec_pause import DraftPause


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--windows", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--append", default=None)
    a = ap.parse_args()
    prompts = heldout_prompts("mini")[:a.prompts]
    rows = []
    for k in a.ks:
        llm = LLM("mini", device=a.device, max_batch_size=max(a.concurrency), max_num_tokens=2048, max_seq_len=1024,
                  speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k})
        for c in a.concurrency:
            base = None
            for window in [None] + a.windows:
                llm.engine.pause = None if window is None else DraftPause(0.3, window=window)
                llm.engine.reset_stats()
                toks = 0
                for i in range(0, len(prompts), c):  # c requests at a time
                    outs = llm.generate(prompts[i:i + c], SamplingParams(max_tokens=a.gen, ignore_eos=True))
                    toks += sum(len(o.outputs[0].token_ids) for o in outs)
                per_step = toks / llm.engine.num_steps
                base = base or per_step
                st = llm.get_stats()["speculative"]
                pz = llm.engine.pause.as_dict() if window else None
                rows.append([k, c, "off" if window is None else f"0.3 over {window} drafts", f"{per_step:.3f}",
                             f"{per_step / base:.3f}", f"{st['acceptance_rate']:.3f}",
                             "-" if pz is None else f"{pz['num_pauses']} / {pz['num_resumes']}",
                             "-" if pz is None else f"{pz['num_paused_steps']} / {llm.engine.num_steps}"])
                print(rows[-1], flush=True)
        del llm
    report(f"The drafting pause on mini (trained MTP layer), {a.prompts} held-out prompts x {a.gen} tokens, greedy",
           table(["k", "concurrency", "drafting pause", "tokens / step", "vs no pause", "acceptance",
                  "pauses / resumes", "paused steps / steps"], rows), a.append)


if __name__ == "__main__":
    main()
