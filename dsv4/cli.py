"""The ``dsv4`` command: ``init-random`` (a deterministic random checkpoint), ``generate`` (for a person at
a terminal) and ``serve`` (an OpenAI-compatible HTTP server, ``dsv4.serve``). The benchmark lives in
``dsv4-bench``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

_DTYPES = ("fp32", "bf16")


def _init_random(args) -> int:
    import torch

    from .checkpoint.init_random import init_random_checkpoint
    from .checkpoint.tokenizer import write_byte_tokenizer
    from .config import ConfigError, get_preset

    try:
        cfg = get_preset(args.preset)
    except ConfigError as e:
        print(f"dsv4 init-random: {e}", file=sys.stderr)
        return 2
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"dsv4 init-random: --out {args.out} is a file; give a directory (it is created if missing)",
              file=sys.stderr)
        return 2
    if not -(1 << 63) <= args.seed < (1 << 64):  # what torch.Generator.manual_seed takes
        print(f"dsv4 init-random: --seed {args.seed}: give an integer in [-2**63, 2**64 - 1]", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    try:
        os.makedirs(args.out, exist_ok=True)  # (before the weights are drawn: a big preset takes a while)
        init_random_checkpoint(cfg, args.out, seed=args.seed, dtype=dtype, naming=args.naming)
        tok = write_byte_tokenizer(args.out, cfg.vocab_size) if cfg.vocab_size <= 1024 else None
    except OSError as e:
        print(f"dsv4 init-random: cannot write --out {args.out}: {e.strerror or e}"
              + (f" ({e.filename})" if e.filename else ""), file=sys.stderr)
        return 2
    print(f"wrote a random {args.preset} checkpoint (seed {args.seed}, {args.dtype}, {args.naming} naming)"
          f" to {args.out}" + (" with a byte-level tokenizer" if tok else ""))
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r}: give token ids as integers, e.g. '1 2 3'") from None
    if not ids:
        raise ValueError("--prompt-ids is empty: give at least one token id, e.g. '1 2 3'")
    return ids


def _generate(args) -> int:
    from . import LLM, SamplingParams
    from .engine.config import EngineConfigError
    from .engine.engine import RequestError

    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": args.mtp} if args.mtp else None
    try:  # the request's own settings first: they fail before any weight is read
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
        ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
        if args.prompt is not None:
            try:
                args.prompt.encode("utf-8")
            except UnicodeEncodeError:  # (bytes that are not UTF-8 reach Python as lone surrogates)
                raise ValueError("--prompt is not UTF-8 text; give the prompt as UTF-8") from None
    except ValueError as e:
        print(f"dsv4 generate: {str(e).replace('SamplingParams.', '--').replace('_', '-')}", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_batch_size=1,
                  max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len, speculative_config=spec)
    except (EngineConfigError, FileNotFoundError, ValueError) as e:
        print(f"dsv4 generate: {e}", file=sys.stderr)
        return 2
    if ids is not None:
        prompt = ids
    elif llm.tokenizer is None:
        print("dsv4 generate: this model has no tokenizer.json; pass --prompt-ids '1 2 3' instead of --prompt",
              file=sys.stderr)
        return 2
    else:
        prompt = args.prompt
    shown = 0
    try:
        for out in llm.generate_stream(prompt, sp):
            if out.error:
                raise RequestError(out.error)
            comp = out.outputs[0]
            if llm.tokenizer is not None:
                text = llm.tokenizer.decode(comp.token_ids)
                sys.stdout.write(text[shown:])
                shown = len(text)
            else:
                new = comp.token_ids[shown:]
                sys.stdout.write("".join(f"{t} " for t in new))
                shown = len(comp.token_ids)
            sys.stdout.flush()
            if out.finished:
                print(f"\n[{len(comp.token_ids)} tokens, finish: {comp.finish_reason}]")
    except RequestError as e:
        print(f"\ndsv4 generate: {e}", file=sys.stderr)
        return 2
    spec_stats = llm.get_stats()["speculative"]
    if spec_stats:
        pause = spec_stats.get("pause")
        paused = f", drafting paused {pause['num_paused_steps']} steps" if pause and pause["num_paused_steps"] else ""
        print(f"[MTP: acceptance {spec_stats['acceptance_rate']:.2f}, mean accepted length "
              f"{spec_stats['mean_accepted_len']:.2f}{paused}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4", description=__doc__)
    p.add_argument("--log_level", default="warning", type=str.lower,
                   choices=("debug", "info", "warning", "error", "critical"))
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("init-random", help="write a deterministic random checkpoint")
    r.add_argument("--preset", default="tiny", help="tiny, tiny-r128, flash, pro, flash-L<n>-E<m>")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", choices=_DTYPES, default="fp32")
    r.add_argument("--naming", choices=("deepseek", "hf"), default="deepseek")
    r.set_defaults(fn=_init_random)

    g = sub.add_parser("generate", help="generate from a prompt, streaming to the terminal")
    g.add_argument("--model", required=True, help="checkpoint directory, built-in model (mini) or preset name")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt-ids", help="token ids, e.g. '1 2 3'")
    g.add_argument("--mtp", type=int, default=0, help="MTP draft tokens per step (0 = off)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-seq-len", type=int, default=None)
    g.add_argument("--max-num-tokens", type=int, default=2048)
    g.set_defaults(fn=_generate)

    from .serve.launch import add_parser as add_serve_parser  # light: the server's imports wait for its run

    add_serve_parser(sub)

    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
