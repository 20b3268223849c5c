"""Every metric Kvasir exports, declared once: its name, kind, help text and (for histograms) bucket
bounds. The runtime's /metrics (`kvasir.runtime.server.metrics`), the operator's
(`kvasir.operator.metrics`), the autoscaler's parser (`kvasir.operator.autoscaler.metrics`), the
dashboards and alert rules (`kvasir.observability.promql`) and the simulator's histograms all read
them from here, so a renamed metric or a moved bucket bound changes everything that depends on it.

No imports: the runtime, the operator image (no torch) and the simulator can all load it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One metric family. `name` is what the exporter registers (prometheus-client appends
    `_total` to a counter's samples); `series` is what PromQL reads."""

    name: str
    kind: str  # counter, gauge or histogram
    help: str
    buckets: tuple[float, ...] = ()

    @property
    def series(self) -> str:
        return f"{self.name}_total" if self.kind == "counter" else self.name


# ---- latency buckets ----------------------------------------------------------------------------
# Each list holds the usual SLO thresholds (a latency SLI can only be read at a bucket boundary):
# TTFT 0.1, 0.25, 0.5, 1, 2.5 s; ITL 10, 25, 50, 100 ms; end-to-end and queue 1, 5, 10, 30, 60 s.
# TTFT also has 1.25-4 s between vLLM's bounds, so that an autoscaler reads a percentile near a
# 1-2.5 s objective without interpolating over a 1.5 s wide bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Per-request time per output token: finer than ITL's around the usual TPOT SLOs (25-250 ms), where
# an autoscaler reads a percentile against the objective and its margin.
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25, 0.3, 0.35, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip

# ---- the runtime (kvasir serve), per pod, labelled by model_name ----------------------------------
RUNNING = Metric("kvasir_requests_running", "gauge", "Requests in the running batch.")
WAITING = Metric("kvasir_requests_waiting", "gauge", "Requests waiting to run (preempted included).")
KV_USAGE = Metric("kvasir_kv_cache_usage_ratio", "gauge", "Share of KV-cache blocks in use (0..1).")
CPU_THREADS = Metric(
    "kvasir_cpu_threads",
    "gauge",
    "CPU threads the engine's steps run on (re-chosen from step times when the count is the default); 0 on a GPU.",
)
TENSOR_PARALLEL_SIZE = Metric(
    "kvasir_tensor_parallel_size",
    "gauge",
    "Ranks the model is split across (--tensor-parallel-size), one process each; 1: no split.",
)
PREEMPTIONS = Metric("kvasir_preemptions", "counter", "Requests preempted (recomputed later).")
PREFIX_QUERIES = Metric(
    "kvasir_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."
)
PREFIX_HITS = Metric("kvasir_prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.")
SPEC_DRAFTS = Metric(
    "kvasir_spec_decode_num_drafts", "counter", "Verified runs of draft tokens (one per request and step)."
)
SPEC_DRAFT_TOKENS = Metric(
    "kvasir_spec_decode_num_draft_tokens", "counter", "Draft tokens proposed and verified."
)
SPEC_ACCEPTED_TOKENS = Metric(
    "kvasir_spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted by the target."
)
SPEC_ACCEPTED_PER_POSITION = Metric(
    "kvasir_spec_decode_num_accepted_tokens_per_pos",
    "counter",
    "Accepted draft tokens by position in the draft (0 = first); divided by num_drafts, the "
    "acceptance rate per position.",
)
TTFT = Metric(
    "kvasir_time_to_first_token_seconds", "histogram", "Arrival to first output token.", TTFT_BUCKETS
)
ITL = Metric(
    "kvasir_inter_token_latency_seconds", "histogram", "Time between consecutive output tokens.", ITL_BUCKETS
)
REQUEST_TPOT = Metric(
    "kvasir_request_time_per_output_token_seconds",
    "histogram",
    "A request's mean time per output token after the first (the mean of its inter-token gaps): "
    "the SLI of an inter-token latency SLO.",
    TPOT_BUCKETS,
)
E2E = Metric(
    "kvasir_e2e_request_latency_seconds", "histogram", "Arrival to the last output token.", E2E_BUCKETS
)
QUEUE_TIME = Metric(
    "kvasir_request_queue_time_seconds", "histogram", "Arrival to first scheduled.", QUEUE_BUCKETS
)
PROMPT_TOKENS = Metric("kvasir_prompt_tokens", "counter", "Prompt tokens of requests served.")
GENERATION_TOKENS = Metric("kvasir_generation_tokens", "counter", "Output tokens generated.")
FINISHED = Metric("kvasir_requests_finished", "counter", "Requests (choices) finished, by finish reason.")
REJECTED = Metric(
    "kvasir_requests_rejected", "counter", "Requests turned away before reaching the engine, by reason."
)
TIME_TO_READY = Metric(
    "kvasir_time_to_ready_seconds",
    "gauge",
    "How long this server took to become ready, by phase: process (process start to loading, mostly "
    "imports), model_files (finding or downloading the model, its config and tokenizer), weights, "
    "kv_cache, kernel_warmup and cuda_graphs (on a GPU), engine_setup (the rest of the engine), "
    "warmup (the first request through the whole path) and total (process start to ready).",
)

# What the Gateway API Inference Extension's endpoint picker reads beyond queue and KV usage, in
# vLLM's label format: the picker takes the sample with the newest value (a timestamp).
LORA_INFO = Metric(
    "kvasir_lora_requests_info",
    "gauge",
    "LoRA adapters running and waiting (labels running_lora_adapters, waiting_lora_adapters, "
    "max_lora); the value is when it was read, in Unix seconds.",
)
CACHE_CONFIG_INFO = Metric(
    "kvasir_cache_config_info",
    "gauge",
    "The KV cache's layout (labels block_size, num_gpu_blocks); always 1.",
)

RUNTIME = (
    RUNNING, WAITING, KV_USAGE, CPU_THREADS, TENSOR_PARALLEL_SIZE, PREEMPTIONS, PREFIX_QUERIES, PREFIX_HITS, TTFT, ITL, REQUEST_TPOT, E2E,
    QUEUE_TIME, PROMPT_TOKENS, GENERATION_TOKENS, FINISHED, REJECTED, TIME_TO_READY, LORA_INFO,
    CACHE_CONFIG_INFO,
)  # fmt: skip
SPEC_DECODE = (SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED_TOKENS, SPEC_ACCEPTED_PER_POSITION)
# LoRA adapters (docs/lora.md): requests per adapter, labelled only with adapters loaded now (an
# unloaded adapter's series goes with it, so the label set stays bounded), and load times.
LORA_REQUESTS = Metric(
    "kvasir_lora_requests",
    "counter",
    "Requests admitted per LoRA adapter (label lora_name: adapters loaded now only).",
)
LORA_LOAD_SECONDS = Metric(
    "kvasir_lora_load_seconds",
    "histogram",
    "How long loading a LoRA adapter took (reading and checking its files), start-up and run-time loads.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
LORA = (LORA_REQUESTS, LORA_LOAD_SECONDS)
# Structured output and tool calling (exported once a request has asked for a grammar).
STRUCTURED_REQUESTS = Metric(
    "kvasir_structured_output_requests",
    "counter",
    "Requests with a grammar (JSON schema, regex, choice, Lark, tool calls), by kind and outcome "
    "(compiled, cached: found compiled or compiling, invalid, deadline).",
)
STRUCTURED_COMPILE_SECONDS = Metric(
    "kvasir_structured_output_compile_seconds",
    "histogram",
    "Time each grammar took to compile (once per grammar; requests that found it cached, or joined "
    "its compile, add nothing).",
    (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0),
)
STRUCTURED_MASK_SECONDS = Metric(
    "kvasir_structured_output_mask_seconds",
    "histogram",
    "Time to compute one sequence's token mask for one step (off the engine thread, during the "
    "forward pass).",
    (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01),
)
STRUCTURED = (STRUCTURED_REQUESTS, STRUCTURED_COMPILE_SECONDS, STRUCTURED_MASK_SECONDS)
# What the model's weights were loaded as (constant after start-up; docs/quantization.md).
WEIGHT_LAYERS = Metric(
    "kvasir_model_weight_layers",
    "gauge",
    "Linear and embedding layers of the loaded model by quantization method and kernel that runs them.",
)
WEIGHT_BYTES = Metric(
    "kvasir_model_weight_bytes",
    "gauge",
    "Bytes the loaded weights take where they live, by quantization method.",
)
WEIGHTS = (WEIGHT_LAYERS, WEIGHT_BYTES)

# ---- the operator (its metrics carry the LLMDeployment's namespace and name) -----------------------
RECONCILES = Metric(
    "kvasir_operator_reconciles", "counter", "Reconciles of an LLMDeployment, by trigger and result."
)
RECONCILE_ERRORS = Metric("kvasir_operator_reconcile_errors", "counter", "Failed reconciles, by reason.")
RECONCILE_DURATION = Metric(
    "kvasir_operator_reconcile_duration_seconds",
    "histogram",
    "Wall time of one reconcile.",
    (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CHILD_WRITES = Metric(
    "kvasir_operator_child_writes", "counter", "Children created or patched, by kind and action."
)
LEADER = Metric("kvasir_operator_leader", "gauge", "1 while this replica holds the leader lease.")
DESIRED = Metric(
    "kvasir_operator_autoscaler_desired_replicas",
    "gauge",
    "The replica count the autoscaler asks for, per LLMDeployment.",
)
REPLICAS = Metric(
    "kvasir_operator_autoscaler_replicas",
    "gauge",
    "The pods of each autoscaled LLMDeployment by state (current: spec.replicas; ready; "
    "starting: created, not ready, within the learned time-to-ready; stuck: long past it).",
)
SIGNAL = Metric(
    "kvasir_operator_autoscaler_signal",
    "gauge",
    "The autoscaler's signals of the last decision (kv_cache_usage, queue_per_replica, itl_ratio, ...).",
)
TARGET = Metric(
    "kvasir_operator_autoscaler_target", "gauge", "The autoscaler's targets, to plot next to the signals."
)
DECISIONS = Metric(
    "kvasir_operator_autoscaler_decisions",
    "counter",
    "Autoscaler decisions by kind (scale_up, scale_down, hold, stabilizing, blocked, no_metrics).",
)
SCRAPE_FAILURES = Metric(
    "kvasir_operator_autoscaler_scrape_failures",
    "counter",
    "Pod metrics the autoscaler could not read (timeouts, errors, bad expositions).",
)
TICK_DURATION = Metric(
    "kvasir_operator_autoscaler_tick_duration_seconds",
    "histogram",
    "Wall time of one autoscaler tick of one LLMDeployment (pods, scrapes, decision, writes).",
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)

OPERATOR = (
    RECONCILES, RECONCILE_ERRORS, RECONCILE_DURATION, CHILD_WRITES, LEADER, DESIRED, REPLICAS, SIGNAL,
    TARGET, DECISIONS, SCRAPE_FAILURES, TICK_DURATION,
)  # fmt: skip

# ---- the router (kvasir router) --------------------------------------------------------------------
ROUTER_DECISIONS = Metric(
    "kvasir_router_decisions",
    "counter",
    "Requests routed, by what decided the backend (prefix, load, unknown_metrics, unreachable).",
)
ROUTER_RETRIES = Metric(
    "kvasir_router_retries",
    "counter",
    "Requests sent to another backend before any byte reached the client, by why (status_429, "
    "status_503, connect, bad_response: not valid HTTP, timeout: no first byte within "
    "--first-byte-timeout).",
)
ROUTER_BACKEND_REQUESTS = Metric(
    "kvasir_router_backend_requests", "counter", "Requests sent to each backend."
)
ROUTER_BACKEND_ERRORS = Metric(
    "kvasir_router_backend_errors",
    "counter",
    "Failures per backend, by kind (connect, refused: 429/503, bad_response: not valid HTTP, "
    "timeout: no first byte in time, stream_broken: the backend went away mid-answer); backends are "
    "labelled by their index (the router logs each index's address once).",
)
ROUTER_BACKEND_IN_FLIGHT = Metric(
    "kvasir_router_backend_in_flight", "gauge", "Requests the router is proxying to each backend now."
)
ROUTER_BACKEND_WAITING = Metric(
    "kvasir_router_backend_waiting", "gauge", "Each backend's waiting requests, as last scraped."
)
ROUTER_BACKEND_KV_USAGE = Metric(
    "kvasir_router_backend_kv_cache_usage_ratio", "gauge", "Each backend's KV-cache usage, as last scraped."
)
ROUTER_BACKEND_METRICS_KNOWN = Metric(
    "kvasir_router_backend_metrics_known",
    "gauge",
    "1 while a backend's last /metrics scrape succeeded; 0 while its load is unknown.",
)

# Scale from zero: requests the router holds while no backend is ready.
ROUTER_HELD_REQUESTS = Metric(
    "kvasir_router_held_requests", "gauge", "Requests held now, waiting for a first ready backend."
)
ROUTER_HELD = Metric(
    "kvasir_router_held",
    "counter",
    "Requests that were held, by how the hold ended (released, timed_out, rejected_full: the hold "
    "queue was full, client_gone, draining: the router shut down).",
)
ROUTER_ACTIVATIONS = Metric(
    "kvasir_router_activations",
    "counter",
    "Times the router scaled its LLMDeployment from 0 to 1 replica (a PATCH of its scale accepted).",
)
ROUTER = (
    ROUTER_DECISIONS, ROUTER_RETRIES, ROUTER_BACKEND_REQUESTS, ROUTER_BACKEND_ERRORS, ROUTER_BACKEND_IN_FLIGHT,
    ROUTER_BACKEND_WAITING, ROUTER_BACKEND_KV_USAGE, ROUTER_BACKEND_METRICS_KNOWN, ROUTER_HELD_REQUESTS,
    ROUTER_HELD, ROUTER_ACTIVATIONS,
)  # fmt: skip
