"""The server's Prometheus metrics (prometheus_client), in a registry of its own so that several apps in one
process (tests) do not collide. Names follow vLLM's where one exists, under the ``dsv4:`` prefix.

Request-level metrics are observed by the HTTP side when a request ends; engine-level ones (queue time,
running / waiting requests, KV cache use, MTP acceptance) from the engine loop's message after each step.
``dsv4:engine_info`` names the process the engine runs in (``pid``, ``server_pid``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.5, 0.75, 1.0, 2.5)
_STEP_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self._children: dict = {}
        labels = ["model_name"]
        self._model = model_name
        self.requests = Counter("dsv4:request_success", "Requests finished, by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.http_errors = Counter("dsv4:request_errors", "Requests refused, by HTTP status",
                                   labels + ["status"], registry=r)
        self.prompt_tokens = Counter("dsv4:prompt_tokens", "Prompt tokens of requests served", labels, registry=r)
        self.generation_tokens = Counter("dsv4:generation_tokens", "Tokens generated", labels, registry=r)
        self.ttft = Histogram("dsv4:time_to_first_token_seconds", "Arrival to the first generated token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dsv4:e2e_request_latency_seconds", "Arrival to the last token", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dsv4:time_per_output_token_seconds", "Mean time between tokens after the first",
                              labels, buckets=_TPOT_BUCKETS, registry=r)
        self.queue_time = Histogram("dsv4:request_queue_time_seconds", "Arrival to the first scheduled step",
                                    labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram("dsv4:request_prompt_tokens", "Prompt length of requests", labels,
                                    buckets=_TOKEN_BUCKETS, registry=r)
        self.generation_len = Histogram("dsv4:request_generation_tokens", "Generated tokens per request", labels,
                                        buckets=_TOKEN_BUCKETS, registry=r)
        self.running = Gauge("dsv4:num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge("dsv4:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge("dsv4:kv_cache_usage_perc", "Share of the KV cache's blocks in use (0-1)", labels,
                              registry=r)
        self.kv_slots_used = Gauge("dsv4:kv_cache_slots_used", "KV cache request slots in use", labels, registry=r)
        self.kv_slots = Gauge("dsv4:kv_cache_slots", "KV cache request slots", labels, registry=r)
        self.kv_blocks_free = Gauge("dsv4:kv_cache_free_blocks", "KV cache blocks free", labels, registry=r)
        self.engine_steps = Counter("dsv4:engine_steps", "Engine steps run", labels, registry=r)
        self.engine_step_time = Histogram("dsv4:engine_step_seconds", "Wall time of one engine step, by what it ran:"
                                          " graph (a CUDA graph replayed), eager (a decode / verify batch no graph"
                                          " fits), prefill (eager, with prefill chunks), readback (the overlap"
                                          " scheduler's last read)", labels + ["kind"], buckets=_STEP_BUCKETS,
                                          registry=r)
        self.spec_drafts = Counter("dsv4:spec_decode_num_draft_tokens", "MTP draft tokens proposed", labels,
                                   registry=r)
        self.spec_accepted = Counter("dsv4:spec_decode_num_accepted_tokens", "MTP draft tokens accepted", labels,
                                     registry=r)
        self.spec_acceptance = Gauge("dsv4:spec_decode_acceptance_rate", "MTP drafts accepted / proposed, since start",
                                     labels, registry=r)
        self.spec_paused = Gauge("dsv4:spec_decode_drafting_paused", "1 while MTP drafting is paused (too few drafts"
                                 " accepted; speculative_config.pause_below_acceptance), else 0", labels, registry=r)
        self.engine = Info("dsv4:engine", "The engine's process (pid) and the HTTP server's (server_pid)", labels,
                           registry=r)

    def m(self, metric, **labels):
        """The metric's child for this model (and ``labels``), looked up once (``labels()`` checks and locks on
        every call, and the engine's metrics are observed every step)."""
        key = (metric, *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(model_name=self._model, **labels)
        return child

    def observe_request(self, finish_reason: str, num_prompt: int, num_generated: int, ttft_s: float | None,
                        e2e_s: float) -> None:
        self.m(self.requests, finished_reason=finish_reason).inc()
        self.m(self.prompt_tokens).inc(num_prompt)
        self.m(self.generation_tokens).inc(num_generated)
        self.m(self.prompt_len).observe(num_prompt)
        self.m(self.generation_len).observe(num_generated)
        self.m(self.e2e).observe(e2e_s)
        if ttft_s is not None:
            self.m(self.ttft).observe(ttft_s)
            if num_generated > 1:
                self.m(self.tpot).observe((e2e_s - ttft_s) / (num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
