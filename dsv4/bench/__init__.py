"""``dsv4-bench``: a throughput benchmark shaped like TensorRT-LLM's ``trtllm-bench``.

The command line, the ``--config`` YAML (LLM-API key names), the JSON-lines dataset and the report mirror
trtllm-bench's, so a command line written for it runs here with only the program name and the model changed.

    cli.py       argument parsing for ``throughput`` and ``prepare-dataset``; exit codes; messages
    options.py   CLI flags + YAML -> one dict of LLM settings, validated by the engine's typed schema
    dataset.py   the JSON-lines dataset: reading, validation, and synthetic ``token-norm-dist`` requests
    runner.py    the timed run: warmup requests, then the dataset at a fixed concurrency through ``LLMEngine``
    report.py    the metrics (throughput, latency / TTFT / TPOT percentiles, MTP acceptance) and their printout
"""
