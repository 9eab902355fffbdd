"""``dsv4-bench``: trtllm-bench's command line for this engine.

    dsv4-bench --model tiny prepare-dataset --output /tmp/ds.jsonl token-norm-dist \\
        --num-requests 128 --input-mean 24 --output-mean 12 --input-stdev 4 --output-stdev 2
    dsv4-bench --model tiny throughput --dataset /tmp/ds.jsonl --concurrency 32 --config mtp.yml

Exit status: 0 when every request completed; 1 when the run finished but some requests failed (each named in
the report); 2 for options, a config file, a dataset or settings that cannot be used (a message, no traceback);
3 when a rank of a multi-device run failed during the run (the report covers the requests that finished before
it: unlike 1, running again may well succeed); 130 after Ctrl-C during the run (likewise a partial report).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

log = logging.getLogger("dsv4.bench")

PROG = "dsv4-bench"
EXIT_RANK_FAILED = 3
LOG_LEVELS = {"internal_error": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
              "info": logging.INFO, "verbose": logging.DEBUG, "debug": logging.DEBUG, "trace": logging.DEBUG}


class UsageError(Exception):
    """Reported as one line on stderr, exit 2."""


class _HoldWarnings(logging.Filter):
    """Holds back WARNING records (to drop the ones that reappear as the LLM's notes)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            self.records.append(record)
            return False
        return True


def _err(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def _note(msg: str) -> None:
    print(f"{PROG}: note: {msg}", file=sys.stderr)


def _opt(parser, *names, **kw):
    """An option under trtllm-bench's spelling (``--max_batch_size``) plus the dashed one."""
    spelled = list(names)
    for n in names:
        if n.startswith("--") and "_" in n:
            spelled.append(n.replace("_", "-"))
    return parser.add_argument(*spelled, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Throughput benchmark for dsv4, mirroring trtllm-bench.",
                                epilog="Exit status: 0 all requests completed, 1 some failed, 2 unusable input,"
                                       " 3 a rank failed mid-run (partial report), 130 Ctrl-C (partial report).")
    p.add_argument("-m", "--model", help="model name (a preset name such as 'tiny' also works as the model)")
    _opt(p, "--model_path", help="checkpoint directory or preset name (default: --model)")
    p.add_argument("-w", "--workspace", help="directory for intermediate files (dsv4-bench builds no engines and"
                   " writes none there; created if missing)")
    _opt(p, "--log_level", default="warning", type=str.lower, choices=sorted(LOG_LEVELS))
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{throughput,prepare-dataset}")

    t = sub.add_parser("throughput", help="run a throughput benchmark over a dataset")
    t.add_argument("--dataset", required=True, help="JSON lines: task_id, input_ids or prompt, output_tokens")
    _opt(t, "--num_requests", type=int, default=0, help="requests to run from the dataset's start (0 = all)")
    t.add_argument("--warmup", type=int, default=2, help="requests run before timing, not reported (default 2)")
    _opt(t, "--max_batch_size", type=int, help="most requests per engine step (default: the engine's, 64)")
    _opt(t, "--max_num_tokens", type=int, help="most tokens per engine step (default: the engine's, 8192)")
    _opt(t, "--max_seq_len", type=int, help="longest prompt + output (default: the dataset's longest)")
    _opt(t, "--beam_width", type=int, default=1, help="1 only (no beam search)")
    _opt(t, "--kv_cache_free_gpu_mem_fraction", type=float,
         help="kv_cache_config.free_gpu_memory_fraction (the YAML's value wins when both are given)")
    t.add_argument("--concurrency", type=int, default=-1, help="most requests in flight (-1 = unlimited)")
    t.add_argument("--tp", type=int, default=None, help="tensor_parallel_size (default 1)")
    t.add_argument("--pp", type=int, default=None, help="pipeline_parallel_size (default 1)")
    t.add_argument("--ep", type=int, default=None, help="moe_expert_parallel_size (default 1)")
    t.add_argument("--streaming", action="store_true", help="report TTFT/TPOT as trtllm-bench's streaming mode")
    t.add_argument("--backend", default=None, help="pytorch (the only one here)")
    _opt(t, "--config", "--extra_llm_api_options", dest="config",
         help="YAML of LLM-API settings overriding the flags")
    _opt(t, "--report_json", help="write the whole report as JSON here")
    _opt(t, "--iteration_log", help="write one JSON line per engine step here")
    t.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    t.add_argument("--dtype", default=None, help="auto (fp32 on CPU, bf16 on CUDA), fp32, bf16, fp16")
    t.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (torch.set_num_threads; default: torch's). On a small shared CPU"
                        " machine 1 is often much faster: spinning threads of a busy machine stall each step")
    _opt(t, "--no_progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=_throughput)

    d = sub.add_parser("prepare-dataset", help="write a synthetic dataset (JSON lines)")
    _opt(d, "--output", dest="pd_output", help="file to write (default: stdout)")
    d.add_argument("--stdout", dest="pd_stdout", action="store_true", help="write to stdout")
    _opt(d, "--random_seed", "--seed", dest="pd_seed", type=int, default=None, help="default 0")
    _opt(d, "--vocab_size", dest="pd_vocab", type=int, default=None, help="default: the model's vocabulary")
    dsub = d.add_subparsers(dest="kind", required=True, metavar="{token-norm-dist}")
    n = dsub.add_parser("token-norm-dist", help="normally distributed input/output lengths, random token ids")
    _opt(n, "--num_requests", type=int, required=True)
    _opt(n, "--input_mean", type=float, required=True)
    _opt(n, "--output_mean", type=float, required=True)
    _opt(n, "--input_stdev", type=float, default=0.0)
    _opt(n, "--output_stdev", type=float, default=0.0)
    # also accepted after the dataset kind
    _opt(n, "--output", dest="kind_output", default=None, help=argparse.SUPPRESS)
    n.add_argument("--stdout", dest="kind_stdout", action="store_true", help=argparse.SUPPRESS)
    _opt(n, "--random_seed", "--seed", dest="kind_seed", type=int, default=None, help=argparse.SUPPRESS)
    _opt(n, "--vocab_size", dest="kind_vocab", type=int, default=None, help=argparse.SUPPRESS)
    d.set_defaults(fn=_prepare_dataset)
    return p


def _model_path(args) -> str:
    path = args.model_path or args.model
    if not path:
        raise UsageError("give --model (a built-in model such as 'mini', a preset such as 'tiny', or a checkpoint)"
                         " or --model_path")
    from ..builtin import resolve_model

    return resolve_model(path)


def _model_kind(path: str) -> str:
    from ..builtin import BUILTIN_MODELS, builtin_path
    from ..config import is_checkpoint_dir, is_preset

    if any(builtin_path(n) == path for n in BUILTIN_MODELS):
        return "built-in checkpoint (trained)"
    if is_checkpoint_dir(path):
        return "checkpoint directory"
    if is_preset(path):
        return "built-in preset, random weights"
    raise UsageError(f"{path!r} is neither a checkpoint directory nor a preset name (tiny, tiny-r128, flash-L4-E32"
                     ", ...); give --model_path")


# ---- prepare-dataset -------------------------------------------------------------------------------------

def _prepare_dataset(args) -> int:
    from ..config import ConfigError
    from .dataset import DatasetError

    try:
        return _write_dataset(args)
    except (DatasetError, ConfigError) as e:
        raise UsageError(str(e)) from None


def _write_dataset(args) -> int:
    from .dataset import token_norm_dist, write_jsonl

    output = args.kind_output or args.pd_output
    to_stdout = args.kind_stdout or args.pd_stdout
    if output and to_stdout:
        raise UsageError("give --output PATH or --stdout, not both")
    for flag, v in (("--input_mean", args.input_mean), ("--output_mean", args.output_mean),
                    ("--input_stdev", args.input_stdev), ("--output_stdev", args.output_stdev)):
        if not math.isfinite(v):
            raise UsageError(f"{flag} {v}: give a finite number")
    vocab = args.kind_vocab if args.kind_vocab is not None else args.pd_vocab  # 0 is refused, not ignored
    if vocab is None:
        from ..config import get_preset, load_config

        path = _model_path(args)
        kind = _model_kind(path)
        vocab = (get_preset(path) if kind.endswith("random weights") else load_config(path)).vocab_size
    seed = args.kind_seed if args.kind_seed is not None else (args.pd_seed if args.pd_seed is not None else 0)
    recs = token_norm_dist(args.num_requests, args.input_mean, args.input_stdev, args.output_mean,
                           args.output_stdev, vocab, seed)
    if output:
        try:
            with open(output, "w", encoding="utf-8") as f:
                n = write_jsonl(recs, f)
        except OSError as e:
            raise UsageError(f"cannot write --output {output!r}: {e.strerror or e}") from None
        print(f"wrote {n} requests (input mean {args.input_mean:g}, output mean {args.output_mean:g}, vocab {vocab},"
              f" seed {seed}) to {output}", file=sys.stderr)
    else:
        write_jsonl(recs, sys.stdout)
        sys.stdout.flush()
    return 0


# ---- throughput ------------------------------------------------------------------------------------------

def _run(llm, reqs, args, run_benchmark):
    """(the run's result, a message if the iteration log could not be completed)."""
    ilog, log_error = None, None
    if args.iteration_log:
        try:
            ilog = open(args.iteration_log, "w", encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot write --iteration_log {args.iteration_log!r}: {e.strerror or e}") from None
    try:
        result = run_benchmark(llm, reqs, concurrency=args.concurrency, warmup=args.warmup, iteration_log=ilog,
                               progress=not args.no_progress)
    except OSError as e:  # the iteration log's disk filled up or went away mid-run
        if ilog is None or e.filename not in (None, args.iteration_log):
            raise
        raise UsageError(f"cannot write --iteration_log {args.iteration_log!r}: {e.strerror or e}") from None
    finally:
        if ilog is not None:
            try:
                ilog.close()  # the last lines are written here: a full disk shows now
            except OSError as e:
                log_error = f"cannot write --iteration_log {args.iteration_log!r}: {e.strerror or e}"
    return result, log_error


def _throughput(args) -> int:
    import torch

    from ..cache.layout import CacheConfigError
    from ..checkpoint.schema import CheckpointError
    from ..checkpoint.tokenizer import load_tokenizer
    from ..config import ConfigError
    from ..engine.config import EngineConfigError
    from ..engine.warmup import WarmupError
    from ..parallel.comm import RankError
    from . import dataset as ds
    from .options import BenchOptionsError, load_yaml, resolve
    from .report import build_report, format_report, write_json
    from .runner import run_benchmark

    if args.backend not in (None, "pytorch"):
        raise UsageError(f"--backend {args.backend}: dsv4-bench has one backend, the PyTorch one; pass --backend"
                         " pytorch or leave it out (TensorRT engines and _autodeploy are TensorRT-LLM's)")
    if args.beam_width != 1:
        raise UsageError(f"--beam_width {args.beam_width}: beam search is not supported; use --beam_width 1")
    if args.concurrency == 0 or args.concurrency < -1:
        raise UsageError(f"--concurrency {args.concurrency}: give a positive number or -1 (unlimited)")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: must be >= 0")
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available on this machine; use --device cpu")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be >= 1")
    path = _model_path(args)
    kind = _model_kind(path)
    model = args.model or path
    if args.workspace:
        if os.path.exists(args.workspace) and not os.path.isdir(args.workspace):
            raise UsageError(f"--workspace {args.workspace!r} is a file; give a directory")
        try:
            os.makedirs(args.workspace, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create --workspace {args.workspace!r}: {e.strerror or e}") from None
    for flag, out in (("--report_json", args.report_json), ("--iteration_log", args.iteration_log)):
        if out and os.path.isdir(out):  # refused now, not after the whole run
            raise UsageError(f"{flag} {out!r} is a directory; give a file path")
        if out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise UsageError(f"{flag} {out!r}: the directory {os.path.dirname(os.path.abspath(out))!r} does not"
                             " exist")

    try:
        yaml_settings = load_yaml(args.config) if args.config else {}
        reqs = ds.read_dataset(args.dataset)
        reqs = ds.select(reqs, args.num_requests, where=args.dataset)
        if any(r.input_ids is None for r in reqs):
            ds.tokenize(reqs, load_tokenizer(path), where=args.dataset)
        flags = {"max_batch_size": args.max_batch_size, "max_num_tokens": args.max_num_tokens,
                 "max_seq_len": args.max_seq_len, "tp": args.tp, "pp": args.pp, "ep": args.ep,
                 "kv_cache_free_gpu_mem_fraction": args.kv_cache_free_gpu_mem_fraction,
                 "device": args.device, "dtype": args.dtype}
        derived = {"max_seq_len": max(r.input_len + r.output_tokens for r in reqs)}
        settings = resolve(flags, yaml_settings, args.config, derived)
    except (BenchOptionsError, ds.DatasetError, EngineConfigError, CheckpointError) as e:
        raise UsageError(str(e)) from None
    for o in settings.overrides:
        _note(o)

    from ..llm import LLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    held = _HoldWarnings()  # the LLM logs its notes; they are printed once below, as notes
    engine_log = logging.getLogger("dsv4")
    engine_log.addFilter(held)
    llm = None
    try:
        llm = LLM(path, config=settings.config, warmup=True)  # the settings validated once, in options.resolve
    except (EngineConfigError, CacheConfigError, ConfigError, CheckpointError, WarmupError, FileNotFoundError,
            RankError) as e:
        raise UsageError(f"cannot build the engine: {e}") from None
    finally:
        engine_log.removeFilter(held)
        for rec in held.records:
            if llm is None or rec.getMessage() not in llm.notes:
                engine_log.handle(rec)
    log.info("engine built and warmed up in %.1f s (%s)", time.perf_counter() - t0, ", ".join(llm.warmup_paths))
    for n in llm.notes:
        _note(n)

    try:
        result, log_error = _run(llm, reqs, args, run_benchmark)
    except RankError as e:  # a rank failed in the warmup (the timed run's failure is in its result)
        _err(f"{e}; every rank stopped before the timed run")
        return EXIT_RANK_FAILED
    finally:
        llm.shutdown()  # stops the other ranks of a multi-device run

    notes = list(llm.notes) + list(settings.overrides)
    rep = build_report(llm=llm, settings=settings, result=result, model=model, model_path=path, model_kind=kind,
                       dataset=args.dataset, concurrency=args.concurrency, streaming=args.streaming, notes=notes)
    print(format_report(rep))
    sys.stdout.flush()
    if args.report_json:
        try:
            write_json(rep, args.report_json)
        except OSError as e:
            raise UsageError(f"cannot write --report_json {args.report_json!r}: {e.strerror or e}") from None
    if result.interrupted:
        _err(f"interrupted: the report covers the {sum(r.ok for r in result.records)} requests that finished")
        return 130
    if result.rank_error:
        _err(f"{result.rank_error}; every rank stopped, the report covers the {sum(r.ok for r in result.records)}"
             " requests that finished")
        return EXIT_RANK_FAILED
    if log_error:  # the report stands; the iteration log is incomplete
        _err(log_error)
        return 2
    failed = rep["requests"]["num_failed"]
    if failed:
        _err(f"{failed} of {len(reqs)} requests failed (listed in the report above)")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=LOG_LEVELS[args.log_level], format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except UsageError as e:
        _err(str(e))
        return 2
    except KeyboardInterrupt:  # before the timed run (loading, warmup): nothing to report
        _err("interrupted")
        return 130
    except BrokenPipeError:  # the reader of stdout went away (``--stdout | head``): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
