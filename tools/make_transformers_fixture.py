"""Write tests/fixtures/transformers-<version>-tiny: the ``tiny`` preset's random weights (seed 0) loaded into
transformers' ``DeepseekV4ForCausalLM`` and written by its ``save_pretrained``, so the loader is tested on the
layout a given transformers release writes (5.23 writes DeepSeek's module names under a ``model.`` prefix, 5.17
its own names). Run it with the transformers to capture, e.g. in a venv with ``transformers==5.23.0``:

    python tools/make_transformers_fixture.py tests/fixtures/transformers-5.23-tiny
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(out: str) -> None:
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dsv4.checkpoint.init_random import random_state_dict
    from dsv4.checkpoint.names import model_to_hf
    from dsv4.config import get_preset

    cfg = get_preset("tiny")
    sd = {k: v for k, v in model_to_hf(random_state_dict(cfg, seed=0)).items() if not k.startswith("mtp.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg.to_hf_dict())).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    hf.save_pretrained(out)
    gen = os.path.join(out, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    print(f"transformers {transformers.__version__} wrote {out}: {sorted(os.listdir(out))}")


if __name__ == "__main__":
    main(sys.argv[1])
