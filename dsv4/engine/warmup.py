"""Warmup: before serving, dummy requests go through every path the configuration enables, through the
real cache, and are released (section 6 of the cache doc). Fails early, naming the path that failed."""

from __future__ import annotations

import logging

from ..kernels.compiles import COMPILES
from .sampling_params import SamplingParams
from .spec_pause import DraftPause

log = logging.getLogger("dsv4")


class WarmupError(RuntimeError):
    """A warmup path failed; the message names the path and the cause."""


WAVE_OUT = 8  # the tokens each request of the first-wave path generates (its decode rows beside later prompts)


def warmup_paths(engine) -> list[tuple[str, list[int], int, bool, tuple[int, int | None] | None]]:
    """(name, prompt lengths, max_tokens, with a sampled request, the pause: None for the engine's own, else the
    probe interval of one that pauses at the first rejected draft, and None or, paused from the start, its paused
    steps since the last probe) of each path: a context chunk of max_num_tokens, prompts that fill two such
    steps beside decode rows (``_mixed_prompts``; the kernel path only; where too few prompts fit for that, as
    many as fit in one step), one request's prefill for each prefill
    graph, a decode batch of max_batch_size, and with
    MTP a verify + draft at the configured draft length (it follows the decode batch's first step, so its
    requests generate enough tokens to verify twice; a sampled request follows its greedy batch, see
    ``run_warmup``), and where the engine may pause drafting, the same batch with drafting paused (steps of one
    row with the MTP layer's keep-up pass, probes, and the steps into and out of a pause), then paused from the
    start with no probe in sight: just after a probe (a prompt longer than the MTP ring's span: the keep-up pass
    over its kept rows, ``engine/mtp_rows.py``; then steps without the keep-up pass, ``DraftPause.keep_rows``),
    and far from one from the first step (prompts without the keep-up pass)."""
    cfg = engine.cfg
    L = engine.max_seq_len  # >= 2 (EngineConfig): every path below fits prompt + max_tokens <= L
    # under attention data parallelism every rank has its own batch limits: warm them all up at once
    lanes = engine.num_lanes
    chunk = max(1, min(cfg.max_num_tokens, L - 2))
    batch = min(cfg.max_batch_size * lanes, engine.cache.num_free_slots)
    decode_out = min(2, L - 1)
    decode_prompt = max(1, min(4, L - decode_out))
    paths = [("context chunk of max_num_tokens=%d" % chunk, [chunk] * lanes, min(2, L - chunk), False, None)]
    # a server's first wave: prompts prefilled in full steps of max_num_tokens beside the decode rows of those
    # before them, one prompt split between two steps (its second chunk reads what the first cached). On the
    # kernel path only: there a kernel's first use at new sizes costs (the plain-torch path, on the CPU, would
    # only pay two steps' compute: 15 s more warmup for mini with dsv4-bench's defaults on 2 cores)
    wave = max(1, min(chunk, L - WAVE_OUT))  # (room for decode rows that outlast a few steps)
    mixed = _mixed_prompts(engine, wave, batch, lanes) if engine.runner.use_kernels else 0
    if mixed:
        paths.append((f"prompts in chunks of max_num_tokens beside decode rows ({mixed} x {wave} tokens)",
                      [wave] * mixed, min(WAVE_OUT, L - wave), False, None))
    elif engine.runner.use_kernels:
        # too few prompts of this length to fill two steps (a short max_seq_len): as many as fit in one step, the
        # largest prompt step the configuration allows, when it is larger than the chunk above (a kernel's tile
        # may follow a step's rows: the experts' row blocks, bench/decode_floor.py's 32 x 128 tokens with FP4
        # experts compiled two grouped-GEMM variants after warmup without it)
        n = min(batch, _fit(engine, wave))  # (with ``mixed`` 0 their prompts fit one step)
        if n * wave > lanes * chunk:
            paths.append((f"prompts in one step ({n} x {wave} tokens)", [wave] * n, min(2, L - wave), False, None))
    # one request's prefill replaying each prefill graph (the chunk above replays its own if it has one)
    graphs = engine.runner.graphs
    for T in sorted({min(T, L - 2) for T in (graphs.prefill_tokens if graphs is not None else ())} - {chunk}):
        paths.append((f"one-request prefill graph of {T} tokens", [T], 2, False, None))
    paths.append(("decode batch of max_batch_size=%d" % batch, [decode_prompt] * batch, decode_out, False, None))
    if engine.draft_len:
        steps = 2 + 2 * (engine.draft_len + 1)  # enough to verify twice, where max_seq_len leaves room
        prompt = max(1, min(4, L - steps))
        paths.append((f"MTP verify + draft (draft_len={engine.draft_len}, batch {batch})",
                      [prompt] * batch, min(steps, L - prompt), True, None))
        if engine.pause is not None:  # steps of one row with the keep-up pass, probes, and the steps between
            steps = 8 + 2 * (engine.draft_len + 1)
            prompt = max(1, min(4, L - steps))
            paths.append((f"MTP with drafting paused (keep-up passes and probes, batch {batch})", [prompt] * batch,
                          min(steps, L - prompt), False, (3, None)))
            long = max(prompt, min(engine.cache.layout.swa_cap + 8, L - steps))
            paths.append((f"MTP with drafting paused far from a probe (a prompt's kept rows, then no keep-up pass,"
                          f" batch {batch})", [long] + [prompt] * (batch - 1), min(steps, L - long), False,
                          (10 ** 9, 0)))
            paths.append((f"MTP with drafting paused far from a probe from the first step (prompts without the"
                          f" keep-up pass, batch {batch})", [long] + [prompt] * (batch - 1), min(4, L - long),
                          False, (10 ** 9, 3)))
    return paths


def _mixed_prompts(engine, prompt: int, batch: int, lanes: int) -> int:
    """How many ``prompt``-token requests make two full steps of max_num_tokens and a split prompt (0: fewer
    than two requests fit the batch or the cache, or they would not need a second chunk)."""
    budget = engine.cfg.max_num_tokens
    n = min(batch, lanes * (2 * -(-budget // prompt) + 1), _fit(engine, prompt))
    return n if n >= 2 and n * prompt > lanes * budget else 0


def _fit(engine, prompt: int) -> int:
    """How many ``prompt``-token requests of the warmup's waves the free cache blocks hold."""
    tpb = engine.cache.layout.tokens_per_block
    per_request = -(-(prompt + WAVE_OUT + engine.draft_len) // tpb) + 1  # blocks, the draft lookahead included
    return engine.cache.num_free_blocks // per_request


def run_warmup(engine) -> list[str]:
    """Run every path; the MTP path's greedy batch is followed by one sampled request of a few tokens, so that
    both MTP step kinds run: greedy steps (with CUDA graphs, the whole-step graph) and steps with a sampled
    request (the separate graphs, keyed draws verified on the device). Its end marks where Triton compiles start
    to be logged as paths warmup missed (``dsv4.kernels.compiles``; quiet from the engine's build on,
    ``LLM._build``)."""
    done = []
    for name, prompt_lens, max_tokens, with_sampled, pause in warmup_paths(engine):
        ids = []
        policy = engine.pause
        if pause is not None:  # paused after the first rejected draft, or from the start
            engine.pause = DraftPause(1.0, window=1, probe_every=pause[0])
            if pause[1] is not None:
                engine.pause.pause_now(since_probe=pause[1])
        try:
            params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True) for _ in prompt_lens]
            if with_sampled:
                prompt_lens = prompt_lens + prompt_lens[:1]
                params.append(SamplingParams(max_tokens=min(max_tokens, engine.draft_len + 2), ignore_eos=True,
                                             temperature=1.0, seed=0))
            for i, (n, sp) in enumerate(zip(prompt_lens, params)):
                prompt = [(7 * i + j) % engine.model_cfg.vocab_size for j in range(n)]
                ids.append(engine.add_request(prompt, sp, request_id=f"__warmup_{len(done)}_{i}"))
            while engine.has_unfinished_requests():
                engine.step()
            engine.cache.check_integrity()
        except Exception as e:
            for rid in ids:
                engine.abort_request(rid)
            raise WarmupError(f"warmup path '{name}' failed: {type(e).__name__}: {e}") from e
        finally:
            engine.pause = policy
        for rid in ids:
            engine.requests.pop(rid, None)
        done.append(name)
        log.info("warmup: %s ok", name)
    if engine.draft_len:  # the kept-rows MTP passes at every row count they are padded to
        try:
            counts = engine.runner.warm_mtp_rows()
        except Exception as e:
            raise WarmupError(f"warmup path 'MTP passes over kept rows' failed: {type(e).__name__}: {e}") from e
        if counts:
            done.append(f"MTP passes over kept rows, {counts[0]} to {counts[-1]} rows" if len(counts) > 1
                        else f"MTP passes over kept rows, {counts[0]} rows")
            log.info("warmup: %s ok", done[-1])
    if engine.cache.num_free_slots != engine.cache.num_slots:
        raise WarmupError("warmup left cache slots allocated; the cache leaks")
    engine.reset_stats()  # what users see starts after warmup
    COMPILES.mark()  # a Triton kernel compiled from now on is a path warmup missed: logged as a warning
    return done
