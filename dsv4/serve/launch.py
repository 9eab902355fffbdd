"""``dsv4 serve``: trtllm-serve's command line -> the settings (the same schema and merge rule as dsv4-bench:
the flags make the settings, the ``--extra_llm_api_options`` YAML overrides them key by key) -> the engine
process (it builds the ``LLM``; this process never does) -> the app on uvicorn in this process.

    dsv4 serve mini --port 8000 --extra_llm_api_options examples/mtp.yml
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

PROG = "dsv4 serve"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def serve_defaults(device: str) -> dict:
    """Settings ``dsv4 serve`` takes unless its flags or YAML say otherwise. On CUDA a decode batch pads up to the
    next CUDA-graph bucket (``cuda_graph_config.enable_padding``, off in the LLM API as in TensorRT-LLM's): a
    server's running batch is rarely a bucket's size (31 requests while a finished one's slot waits for the next
    request, with buckets 16 and 32), and a step no bucket fits runs eagerly, several times a graph replay's cost
    on a small model. (The CPU has no graphs.)"""
    return {"cuda_graph_config": {"enable_padding": True}} if str(device).startswith("cuda") else {}


def _opt(parser, *names, **kw):
    """An option under trtllm-serve's spelling (``--max_batch_size``) plus the dashed one."""
    spelled = list(names) + [n.replace("_", "-") for n in names if n.startswith("--") and "_" in n]
    return parser.add_argument(*spelled, **kw)


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (trtllm-serve's flags)",
                       description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models,"
                                   " /health, /version, /metrics, /tokenize, /detokenize.")
    s.add_argument("model", help="checkpoint directory, built-in model (mini) or preset name")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--backend", default=None, help="pytorch (the only one)")
    _opt(s, "--tp_size", type=int, default=None, help="tensor parallel size")
    _opt(s, "--pp_size", type=int, default=None, help="pipeline parallel size (1 only)")
    _opt(s, "--ep_size", type=int, default=None, help="MoE expert parallel size")
    _opt(s, "--max_batch_size", type=int, default=None)
    _opt(s, "--max_num_tokens", type=int, default=None)
    _opt(s, "--max_seq_len", type=int, default=None)
    _opt(s, "--kv_cache_free_gpu_memory_fraction", type=float, default=None)
    _opt(s, "--extra_llm_api_options", "--config", dest="extra_llm_api_options", default=None,
         help="YAML of LLM-API settings (the schema of dsv4-bench's --config); its keys override the flags")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", default=None, help="auto, bf16, fp32")
    _opt(s, "--served_model_name", default=None, help="the model's name in the API (default: the model argument)")
    _opt(s, "--api_key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: none)")
    _opt(s, "--max_request_bytes", type=int, default=8 << 20, help="largest request body (default 8 MiB)")
    _opt(s, "--chat_template", default=None, help="a Jinja chat template file, instead of the checkpoint's or"
         " DeepSeek-V4's built-in format")
    s.add_argument("--threads", type=int, default=None, help="CPU threads for torch (torch.set_num_threads)")
    _opt(s, "--batch_wait_steps", type=int, default=0,
         help="hold new requests that arrive while the engine is busy for up to this many steps (or until they fill"
              " the free batch slots), so that they prefill in one step (default 0: none held)")
    _opt(s, "--log_level", default=argparse.SUPPRESS, type=str.lower, choices=LOG_LEVELS)
    s.set_defaults(fn=run)
    return s


def _fail(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    import torch

    from ..bench.options import BenchOptionsError, load_yaml, resolve
    from ..builtin import resolve_model
    from ..engine.config import EngineConfigError

    if args.backend not in (None, "pytorch"):
        return _fail(f"--backend {args.backend}: dsv4 has one backend, the PyTorch one")
    if not 0 < args.port < 65536:
        return _fail(f"--port {args.port}: give a port in 1..65535")
    if args.max_request_bytes < 1:
        return _fail(f"--max_request_bytes {args.max_request_bytes}: must be >= 1")
    if args.threads is not None and args.threads < 1:
        return _fail(f"--threads {args.threads}: must be >= 1")
    if args.batch_wait_steps < 0:
        return _fail(f"--batch_wait_steps {args.batch_wait_steps}: must be >= 0")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            return _fail(f"cannot read --chat_template {args.chat_template!r}: {e.strerror or e}")
        except UnicodeDecodeError as e:
            return _fail(f"--chat_template {args.chat_template!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at"
                         f" offset {e.start})")
    try:
        yaml_settings = load_yaml(args.extra_llm_api_options) if args.extra_llm_api_options else {}
        flags = {"max_batch_size": args.max_batch_size, "max_num_tokens": args.max_num_tokens,
                 "max_seq_len": args.max_seq_len, "tp": args.tp_size, "pp": args.pp_size, "ep": args.ep_size,
                 "kv_cache_free_gpu_mem_fraction": args.kv_cache_free_gpu_memory_fraction,
                 "device": device, "dtype": args.dtype}
        settings = resolve(flags, yaml_settings, args.extra_llm_api_options, derived=serve_defaults(device))
    except (BenchOptionsError, EngineConfigError) as e:
        return _fail(str(e).replace("--config", "--extra_llm_api_options"))
    for o in settings.overrides:
        print(f"{PROG}: note: {o}".replace("--config", "--extra_llm_api_options"), file=sys.stderr)

    import uvicorn

    from .app import build_app
    from .chat import ChatEncoder, load_chat_template
    from .host import EngineSpec, freeze_heap

    path = resolve_model(args.model)
    try:  # the chat template is checked before the engine is built
        if template is None:
            template = load_chat_template(path if os.path.isdir(path) else None)
        ChatEncoder(template)
    except (OSError, ValueError) as e:
        where = f"--chat_template {args.chat_template!r}" if args.chat_template is not None else \
            f"the chat template of {path}"
        return _fail(f"{where}: {e}")
    level = logging.getLogger().getEffectiveLevel()
    engine = _start_engine(EngineSpec(path, settings.config, args.threads, level, args.batch_wait_steps))
    if isinstance(engine, int):
        return engine
    try:
        name = args.served_model_name or args.model
        app = build_app(engine, name, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                        chat_template=template)
        logging.getLogger("dsv4.serve").info("serving %s on http://%s:%d (chat: %s; engine process %d)", name,
                                             args.host, args.port, app.state.dsv4.encoder.source, engine.info.pid)
        freeze_heap()
        uvicorn.run(app, host=args.host, port=args.port, log_level=logging.getLevelName(level).lower(),
                    timeout_graceful_shutdown=5)
    finally:
        engine.stop()  # (the app's shutdown has done it, unless uvicorn never started)
    return 0


def _start_engine(spec):
    """The engine process, built and warmed up; or the exit status when it could not be (its error printed
    as one line) or the start was interrupted (Ctrl-C, SIGTERM: the process is stopped, nothing is left)."""
    from .host import EngineProcess, EngineStartError

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupted)
    try:
        return EngineProcess(spec)
    except EngineStartError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted while the engine was starting", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
