"""transformers' DeepseekV4ForCausalLM on our weights: the oracle for the main model."""

import warnings

import torch

from dsv4.checkpoint.names import model_to_hf


def hf_model(cfg, state_dict):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_cfg = DeepseekV4Config(**cfg.to_hf_dict())
        hf_cfg._attn_implementation = "eager"
        hf = DeepseekV4ForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(
        {k: v for k, v in model_to_hf(state_dict).items() if not k.startswith("mtp.")}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


def hf_greedy(hf, prompts, max_new):
    """One prompt at a time: transformers' compressors ignore padding (model doc gotcha 7)."""
    outs = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for p in prompts:
            gen = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs
