"""The benchmark report: what trtllm-bench prints, plus MTP acceptance, as a dict (``--report_json``) and a
short readable text.

Definitions (times from ``runner``; ms unless said):
  total time          first request added -> last request finished (seconds)
  request throughput  completed requests / total time
  output throughput   output tokens of completed requests / total time; total token throughput adds their
                      input tokens; per GPU = output throughput / ranks (max(tp, ep) devices)
  request latency     finish - arrival (arrival = when the request was added, so queueing counts)
  TTFT                first token - arrival
  TPOT                (last token - first token) / (output tokens - 1), per request
  per-user output speed          1000 / TPOT (tok/s/user), mean over requests
  per-user output throughput [w/ ctx]  output tokens / latency (tok/s/user), mean over requests
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from .runner import RunResult

_MiB = 1 << 20
PCTS = (50, 90, 95, 99)


def distribution(values: list[float]) -> dict | None:
    """avg, min, p50, p90, p95, p99, max of ``values`` (None when empty)."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    out = {"avg": float(a.mean()), "min": float(a.min())}
    for p in PCTS:
        out[f"p{p}"] = float(np.percentile(a, p))
    out["max"] = float(a.max())
    return out


def _mapping(llm) -> dict | None:
    m = getattr(llm, "mapping", None)
    return m.describe() if m is not None else None


def _world_size(llm) -> int:
    """Devices the run used (ranks): the per-GPU throughput divides by it."""
    m = getattr(llm, "mapping", None)
    if m is not None:
        return m.world_size
    return max(1, llm.config.tensor_parallel_size, llm.config.moe_expert_parallel_size)


def _engine_section(llm, settings, model: str, model_path: str, model_kind: str) -> dict:
    cfg = llm.config
    kvc = cfg.kv_cache_config
    r = llm.resolved
    sizing = r.sizing
    model_dtype = str(r.dtype).replace("torch.", "")  # hc_* params stay fp32
    kv_dtype = kvc.dtype if kvc.dtype != "auto" else f"auto ({r.kv_dtype})"
    tp, pp, ep = cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.moe_expert_parallel_size
    spec = cfg.speculative_config
    return {
        "model": model,
        "model_path": model_path,
        "model_kind": model_kind,
        "device": settings.device,
        "cpu_threads": torch.get_num_threads(),
        "dtype": model_dtype,
        "max_batch_size": cfg.max_batch_size,
        "max_num_tokens": cfg.max_num_tokens,
        "max_seq_len": r.max_seq_len,
        "resolved": r.summary(),
        "kv_cache": {
            "dtype": kv_dtype,
            "tokens_per_block": kvc.tokens_per_block,
            "free_gpu_memory_fraction": kvc.free_gpu_memory_fraction,
            "free_gpu_memory_fraction_from": settings.sources.get("kv_cache_config.free_gpu_memory_fraction",
                                                                  "default"),
            "max_tokens": kvc.max_tokens,
            "max_gpu_memory_bytes": kvc.max_gpu_memory_bytes,
            "num_slots": sizing.num_slots,
            "num_blocks": sizing.num_blocks,
            "bytes_per_slot": sizing.bytes_per_slot,
            "bytes_per_block": sizing.bytes_per_block,
            "slots_bytes": (sizing.num_slots + 1) * sizing.bytes_per_slot,
            "blocks_bytes": (sizing.num_blocks + 1) * sizing.bytes_per_block,
            "token_capacity": sizing.num_blocks * sizing.tokens_per_block,
            "total_bytes": sizing.total_bytes,
            "budget_bytes": sizing.budget_bytes,
            "summary": sizing.describe(),
        },
        "parallel": {"tp": tp, "pp": pp, "ep": ep, "enable_attention_dp": cfg.enable_attention_dp,
                     "world_size": _world_size(llm), "mapping": _mapping(llm)},
        "speculative": ({"decoding_type": spec.decoding_type, "draft_len": spec.draft_len} if spec else None),
        "cuda_graph_config": (vars(cfg.cuda_graph_config) if cfg.cuda_graph_config is not None else None),
        "enforce_eager": cfg.enforce_eager,
        "cuda_graphs": _graphs(llm),
        "overlap_scheduler": _overlap(llm, cfg),
        "moe_backend": cfg.moe_config.backend,
        "expert_format": cfg.moe_config.expert_format,
        "settings": settings.merged,
        "settings_from": settings.sources,
    }


def _overlap(llm, cfg) -> str:
    """on, or off and why (disable_overlap_scheduler, a runner that takes host inputs only, a drafter that
    drafts on the host)."""
    if llm.engine.overlaps_steps:
        return "on"
    if cfg.disable_overlap_scheduler:
        return "off (disable_overlap_scheduler)"
    if not llm.engine.runner.supports_overlap:
        return "off (the runner takes host inputs only)"
    return "off (the drafter drafts on the host)"


def _graphs(llm) -> dict | None:
    """The CUDA graphs the run used: buckets and how many steps replayed them (None: every step eager)."""
    g = getattr(llm.engine.runner, "graphs", None)
    if g is None:
        return None
    keep = getattr(llm.engine.runner, "keep_graphs", None)  # MTP's one-row buckets: paused steps, probes
    return {"captured": g.capture, "batch_sizes": list(g.buckets), "rows_per_request": g.rows,
            "prefill_tokens": list(g.prefill_tokens), "replays": g.num_replays,
            "prefill_replays": g.num_prefill_replays, "keep_up_replays": None if keep is None else keep.num_replays,
            "bare_replays": None if keep is None else keep.num_bare_steps}


def build_report(*, llm, settings, result: RunResult, model: str, model_path: str, model_kind: str,
                 dataset: str, concurrency: int, streaming: bool, notes: list[str]) -> dict:
    recs = result.records
    done = [r for r in recs if r.ok]
    failed = [r for r in recs if not r.ok]
    total_s = max(result.end - result.start, 1e-9)
    out_toks = sum(r.output_len for r in done)
    in_toks = sum(r.input_len for r in done)
    world = _world_size(llm)

    latency = [(r.finish - r.arrival) * 1e3 for r in done]
    ttft = [(r.first_token - r.arrival) * 1e3 for r in done if r.first_token is not None]
    tpot = [(r.token_times[-1][0] - r.first_token) * 1e3 / (r.output_len - 1)
            for r in done if r.output_len > 1 and r.first_token is not None]
    speed = [1e3 / t for t in tpot if t > 0]
    per_user_ctx = [r.output_len / (r.finish - r.arrival) for r in done if r.finish > r.arrival]

    perf = {
        "total_time_s": total_s,
        "request_throughput_req_s": len(done) / total_s,
        "output_throughput_tok_s": out_toks / total_s,
        "total_token_throughput_tok_s": (in_toks + out_toks) / total_s,
        "per_gpu_output_throughput_tok_s": out_toks / total_s / world,
        "per_user_output_speed_tok_s": float(np.mean(speed)) if speed else None,
        "per_user_output_throughput_with_ctx_tok_s": float(np.mean(per_user_ctx)) if per_user_ctx else None,
        "request_latency_ms": distribution(latency),
        "ttft_ms": distribution(ttft),
        "tpot_ms": distribution(tpot),
        "per_user_output_speed_dist_tok_s": distribution(speed),
    }
    return {
        "engine": _engine_section(llm, settings, model, model_path, model_kind),
        "requests": {
            "dataset": dataset,
            "num_requests": len(recs),
            "num_completed": len(done),
            "num_failed": len(failed),
            "num_warmup": result.num_warmup,
            "concurrency": concurrency,
            "streaming": streaming,
            "total_input_tokens": in_toks,
            "total_output_tokens": out_toks,
            "input_len": distribution([r.input_len for r in recs]),
            "output_len": distribution([r.output_len for r in done]),
            "num_engine_steps": result.num_steps,
            "num_preemptions": result.num_preemptions,
            # why the timed run ended before every request did (the report covers what finished), or None
            "stopped_early": result.rank_error or ("interrupted (SIGINT)" if result.interrupted else None),
            # Triton kernels first compiled (or loaded from Triton's disk cache) during the timed run: paths
            # warmup did not run, whose compile time the run paid
            "kernels_compiled": [{"kernel": c.kernel, "ms": round(c.ms, 1), "specialization": c.specialization}
                                 for c in result.compiles],
        },
        "performance": perf,
        "timing_note": ("token times are taken when each engine step returns, in both modes; --streaming was"
                        " given, so TTFT/TPOT are reported as trtllm-bench's streaming metrics" if streaming else
                        "token times are taken when each engine step returns, in both modes; trtllm-bench shows"
                        " TTFT/TPOT only with --streaming, dsv4-bench reports them anyway"),
        "speculative": result.spec,
        "notes": list(notes),
        "errors": [{"index": r.index, "task_id": r.task_id, "line": r.line, "error": r.error or "did not finish"}
                   for r in failed],
        "per_request": [{"task_id": r.task_id, "input_len": r.input_len, "output_tokens": r.output_tokens,
                         "output_len": r.output_len, "finish_reason": r.finish_reason,
                         "latency_ms": (r.finish - r.arrival) * 1e3 if r.ok else None,
                         "ttft_ms": (r.first_token - r.arrival) * 1e3 if r.ok and r.first_token else None,
                         "error": r.error} for r in recs],
    }


# ---- text ------------------------------------------------------------------------------------------------

def _banner(title: str) -> list[str]:
    bar = "=" * 72
    return [bar, f"= {title}", bar]


def _f(v, fmt: str = "{:.4f}") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return fmt.format(v)


def _row(label: str, value) -> str:
    return f"{label + ':':<50} {value}"


def _dist_table(rows: list[tuple[str, dict | None]]) -> list[str]:
    cols = ["avg", "min", "p50", "p90", "p95", "p99", "max"]
    lines = [f"{'':<26}" + "".join(f"{c:>10}" for c in cols)]
    for name, d in rows:
        if d is None:
            lines.append(f"{name:<26}" + f"{'n/a':>10}" * len(cols))
        else:
            lines.append(f"{name:<26}" + "".join(f"{d[c]:>10.2f}" for c in cols))
    return lines


def format_report(rep: dict) -> str:
    e, q, p = rep["engine"], rep["requests"], rep["performance"]
    kv, par = e["kv_cache"], e["parallel"]
    L = []
    L += _banner("ENGINE DETAILS")
    L.append(_row("Model", e["model"]))
    L.append(_row("Model path", f"{e['model_path']} ({e['model_kind']})"))
    L.append(_row("Device / dtype / CPU threads", f"{e['device']} / {e['dtype']} / {e['cpu_threads']}"))
    L.append(_row("Max batch size / max num tokens", f"{e['max_batch_size']} / {e['max_num_tokens']}"))
    L.append(_row("Max sequence length", e["max_seq_len"]))
    L.append(_row("Parallel (TP / PP / EP / attention DP / ranks)",
                  f"{par['tp']} / {par['pp']} / {par['ep']} / {'on' if par['enable_attention_dp'] else 'off'}"
                  f" / {par['world_size']}"))
    spec = e["speculative"]
    L.append(_row("Speculative decoding", f"{spec['decoding_type']}, {spec['draft_len']} draft token(s) per step"
                  if spec else "off"))
    g = e.get("cuda_graphs")
    L.append(_row("CUDA graphs", "none (every step eager)" if g is None else
                  f"{'captured' if g['captured'] else 'static buffers, not captured (CPU)'}: batch sizes"
                  f" {g['batch_sizes']} x {g['rows_per_request']} rows, one-request prefill chunks up to"
                  f" {g.get('prefill_tokens')} tokens; {g['replays']} step(s) replayed"
                  f" ({g.get('prefill_replays', 0)} prefill)"
                  + ("" if g.get("keep_up_replays") is None else
                     f", {g['keep_up_replays']} on the one-row MTP buckets (drafting paused"
                     + (f"; {g['bare_replays']} without the keep-up pass" if g.get("bare_replays") else "") + ")")))
    L.append(_row("Overlap scheduler", e.get("overlap_scheduler", "-")))
    L.append(_row("KV cache dtype / tokens per block", f"{kv['dtype']} / {kv['tokens_per_block']}"))
    L.append(_row("KV cache free memory fraction",
                  f"{kv['free_gpu_memory_fraction']} (from {kv['free_gpu_memory_fraction_from']})"))
    L.append(_row("KV cache size", f"{kv['total_bytes'] / _MiB:.2f} MiB = per-request state"
                  f" {kv['slots_bytes'] / _MiB:.2f} MiB ({kv['num_slots']} slots) + per-token blocks"
                  f" {kv['blocks_bytes'] / _MiB:.2f} MiB ({kv['num_blocks']} blocks, {kv['token_capacity']} tokens)"))
    L.append("  " + kv["summary"])
    L += _banner("REQUEST DETAILS")
    L.append(_row("Dataset", q["dataset"]))
    L.append(_row("Requests (completed / failed)", f"{q['num_requests']} ({q['num_completed']} / {q['num_failed']})"))
    if q["stopped_early"]:
        L.append(_row("Run stopped early", q["stopped_early"]))
    L.append(_row("Warmup requests (untimed)", q["num_warmup"]))
    L.append(_row("Concurrency", "unlimited" if q["concurrency"] < 0 else q["concurrency"]))
    L.append(_row("Average input / output length (tokens)",
                  f"{_f(q['input_len'] and q['input_len']['avg'], '{:.1f}')} / "
                  f"{_f(q['output_len'] and q['output_len']['avg'], '{:.1f}')}"))
    L.append(_row("Engine steps / preemptions", f"{q['num_engine_steps']} / {q['num_preemptions']}"))
    compiled = q.get("kernels_compiled") or []
    if compiled:
        L.append(_row("Kernels compiled during the run", f"{len(compiled)} ({sum(c['ms'] for c in compiled):.0f} ms,"
                      " paid by the run: paths warmup did not run): "
                      + ", ".join(sorted({c["kernel"] for c in compiled}))))
    L += _banner("PERFORMANCE OVERVIEW")
    L.append(_row("Request throughput (req/sec)", _f(p["request_throughput_req_s"])))
    L.append(_row("Total output throughput (tokens/sec)", _f(p["output_throughput_tok_s"])))
    L.append(_row("Total token throughput (tokens/sec)", _f(p["total_token_throughput_tok_s"])))
    L.append(_row("Per user output speed (tps/user)", _f(p["per_user_output_speed_tok_s"])))
    L.append(_row("Per user output throughput [w/ ctx] (tps/user)",
                  _f(p["per_user_output_throughput_with_ctx_tok_s"])))
    L.append(_row("Per GPU output throughput (tps/gpu)", _f(p["per_gpu_output_throughput_tok_s"])))
    L.append(_row("Total latency (ms)", _f(p["total_time_s"] * 1e3)))
    L.append(_row("Average request latency (ms)", _f(p["request_latency_ms"] and p["request_latency_ms"]["avg"])))
    L.append("")
    L += _dist_table([("Request latency (ms)", p["request_latency_ms"]), ("TTFT (ms)", p["ttft_ms"]),
                      ("TPOT (ms)", p["tpot_ms"]), ("Per-user speed (tok/s)", p["per_user_output_speed_dist_tok_s"])])
    L.append("  " + rep["timing_note"])
    s = rep["speculative"]
    if s is not None:
        L += _banner("SPECULATIVE DECODING (MTP)")
        L.append(_row("Draft acceptance rate", _f(s["acceptance_rate"])))
        L.append(_row("Mean accepted length (tokens per verify)", _f(s["mean_accepted_len"])))
        L.append(_row("Per-position acceptance",
                      ", ".join(f"{j + 1}: {a:.4f}" for j, a in enumerate(s["per_position_acceptance"])) or "n/a"))
        L.append(_row("Verify steps / draft tokens / accepted",
                      f"{s['num_verify_steps']} / {s['num_draft_tokens']} / {s['num_accepted_tokens']}"))
        pause = s.get("pause")
        L.append(_row("Drafting paused (steps / pauses / resumes)",
                      "never (pause_below_acceptance 0)" if pause is None else
                      f"{pause['num_paused_steps']} / {pause['num_pauses']} / {pause['num_resumes']}"
                      f" (below {pause['below']} acceptance"
                      + (f"; next probe after {pause['probe_interval']} paused steps)" if "probe_interval" in pause
                         else ")")))
    if rep["notes"]:
        L += _banner("NOTES")
        L += [f"- {n}" for n in rep["notes"]]
    if rep["errors"]:
        L += _banner(f"FAILED REQUESTS ({len(rep['errors'])})")
        for err in rep["errors"][:20]:
            L.append(f"- task_id {err['task_id']} (line {err['line']}): {err['error']}")
        if len(rep["errors"]) > 20:
            L.append(f"- ... and {len(rep['errors']) - 20} more (see --report_json)")
    L.append("=" * 72)
    return "\n".join(L)


def write_json(rep: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=2, default=str)
        f.write("\n")
