"""LLMEngine: `step()` is glue: schedule, execute, update, emit outputs (with async scheduling, the
next step is planned and queued while the current one runs)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.core.kv_cache.events import KVEventLog
from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.engine.kv_events import KVEventPublisher
from kvasir.runtime.engine.output.process import OutputProcess
from kvasir.runtime.engine.output.processor import OutputProcessor
from kvasir.runtime.engine.output.updates import ChoiceUpdate, OutputCollector
from kvasir.runtime.engine.outputs import Completion, GenerationResult, RequestOutput
from kvasir.runtime.engine.prompt_check import PreparedRequest, PromptCheck
from kvasir.runtime.engine.ranks.driver import MirroredRunner
from kvasir.runtime.engine.ranks.start import start_ranks
from kvasir.runtime.loader.model_files import ModelFiles, open_engine_model
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.outputs import StepResult
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.spec_decode.proposer import DraftProposer
from kvasir.runtime.spec_decode.stats import SpecDecodeStats
from kvasir.runtime.startup_phases import StartupPhases
from kvasir.runtime.structured.compiler import GrammarCompiler
from kvasir.runtime.structured.params import StructuredOutputs
from kvasir.runtime.structured.stats import StructuredStats, StructuredStatsSnapshot
from kvasir.runtime.thread_tuner import ThreadTuner
from kvasir.runtime.threads import set_torch_threads, torch_threads, tunable_thread_counts
from kvasir.runtime.worker.kv_budget import num_blocks_for_tokens
from kvasir.runtime.worker.model_runner import ModelRunner, StepOutcome
from kvasir.runtime.worker.step_executor import StepExecutor

logger = logging.getLogger(__name__)

_INT64_MASK = (1 << 63) - 1
# With nothing to run but outputs still in the output process, how long a step waits for them:
# short, so a request arriving meanwhile is not held up.
OUTPUT_WAIT_S = 0.002


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: queue depth, KV usage and the cumulative counters."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off
    # The KV cache's layout (exported for the Gateway API Inference Extension's endpoint picker).
    block_size: int = 0
    num_gpu_blocks: int = 0
    # CPU threads the steps run on (the thread tuner may change them); 0 on a GPU.
    cpu_threads: int = 0
    tensor_parallel_size: int = 1  # ranks the model is split across, one process each
    structured: StructuredStatsSnapshot | None = None  # None: no grammar was asked for yet
    # LoRA: the adapters with running and with waiting requests (names), and the slots (0: off).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0


class LLMEngine:
    """Continuous batching over a paged KV cache; not thread-safe (AsyncEngine wraps it)."""

    def __init__(self, config: EngineConfig, files: ModelFiles | None = None) -> None:
        self.config = config
        # How long each phase took (the server's time-to-ready metric, by phase).
        self.startup = StartupPhases()
        if files is None:
            with self.startup.phase("model_files"):  # download or find, config and tokenizer
                files = open_engine_model(config)
        self.tokenizer: Tokenizer = files.tokenizer
        self.model_config = files.config
        self.structured_stats = StructuredStats()
        self.runner = self._build_runner(files)
        # What the weights were loaded as, for /metrics (fixed once loaded).
        self.weights_report = self.runner.weights_report
        self.max_model_len = self.runner.max_model_len
        self.prompts = PromptCheck(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.drafts = DraftProposer.create(config.speculative_config, self.runner)
        backend = self.tokenizer.backend
        self.grammars = GrammarCompiler(
            backend.to_str,
            self.model_config.vocab_size,
            self.tokenizer.eos_token_ids or self.model_config.eos_token_ids,
            config.grammar_limits,
            self.structured_stats,
        )
        self.grammars.prepare()
        blocks_needed = num_blocks_for_tokens(self.max_model_len, config.block_size)
        if self.runner.num_blocks < blocks_needed:
            raise ValueError(
                f"the KV cache has {self.runner.num_blocks} blocks of {config.block_size} tokens, "
                f"fewer than one sequence of max_model_len={self.max_model_len} needs "
                f"({blocks_needed}); lower --max-model-len or give the KV cache more memory"
            )
        events = config.kv_events_config
        self.kv_events: KVEventPublisher | None = None
        event_log = None
        if events is not None and events.active and config.enable_prefix_caching:
            event_log = KVEventLog(config.block_size, events.hash_seed)
            self.kv_events = KVEventPublisher(events)
            weakref.finalize(self, self.kv_events.close)
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            events=event_log,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=self.runner.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                policy=config.scheduling_policy,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                num_lookahead_tokens=self.drafts.num_lookahead_tokens,
                max_loras=config.max_loras if config.enable_lora else 0,
            ),
            self.kv_cache,
        )
        self.collector = OutputCollector()
        # The text side: in a child process on CUDA by default (its Python stays off this
        # process's GIL), else here.
        self.output_processor = OutputProcessor(self.tokenizer.backend)
        on_cuda = self.runner.device.type == "cuda"
        use_output_process = on_cuda if config.output_process is None else config.output_process
        self.output_process = OutputProcess(self.tokenizer.backend.to_str()) if use_output_process else None
        self._rng = random.Random(config.seed)
        self._eos_token_ids = self.tokenizer.eos_token_ids or self.model_config.eos_token_ids
        self._pending_outputs: list[RequestOutput] = []
        # Async scheduling: steps run on the executor's thread, the next one queued behind the
        # current one. Speculative decoding needs each step's tokens before drafting the next.
        use_async_scheduling = on_cuda if config.async_scheduling is None else config.async_scheduling
        self.executor = StepExecutor(self.runner) if use_async_scheduling else None
        if self.executor is not None:
            # The executor's thread holds the runner (weights, KV cache): an engine dropped without
            # close() must still let it go.
            weakref.finalize(self, self.executor.shutdown)
        if self.output_process is not None:
            weakref.finalize(self, self.output_process.close)
        self._in_flight: _InFlight | None = None
        # On a CPU with the thread count chosen by default, re-choose it from the steps' timings.
        # Not across ranks: one rank's count would change and the others' not, each step then
        # waiting at the collectives for the slowest.
        on_cpu = self.runner.device.type == "cpu" and config.tensor_parallel_size == 1
        counts = tunable_thread_counts() if on_cpu else None
        self.thread_tuner = None if counts is None else ThreadTuner(counts, set_torch_threads)
        logger.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d",
            self.runner.num_blocks,
            config.block_size,
            self.max_model_len,
        )

    def _build_runner(self, files: ModelFiles) -> ModelRunner:
        """This process's runner; with --tensor-parallel-size N > 1, rank 0's, with ranks 1..N-1
        started in their own processes (runtime/engine/ranks/)."""
        if self.config.tensor_parallel_size == 1:
            return ModelRunner(self.config, files, self.startup, self.structured_stats)
        runner = start_ranks(self.config, files, self.startup, self.structured_stats)
        # An engine dropped without close(), or one whose build fails below, still ends its ranks.
        weakref.finalize(self, runner.stop_ranks)
        return runner

    def on_rank_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` (from a monitor thread) if a tensor-parallel rank dies or hangs;
        never called at --tensor-parallel-size 1."""
        if isinstance(self.runner, MirroredRunner):
            self.runner.ranks.on_failure(callback)

    # ---- requests -------------------------------------------------------------------------

    def prepare_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        arrival_time: float | None = None,
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Validate, tokenize and compile the request's grammar (waiting at most the compile
        deadline); raises InvalidParameterError naming the field. Thread-safe; never call it on
        the engine's thread with a grammar (the compile would hold every step). `lora`: the
        adapter the request runs with (None: the base model); `cache_salt`: its prefix-cache hits
        come only from requests with the same salt."""
        if lora is not None and not self.config.enable_lora:
            raise InvalidParameterError("model", "LoRA adapters need --enable-lora")
        prepared = self.prompts.prepare(
            request_id, prompt, params, prompt_token_ids=prompt_token_ids, arrival_time=arrival_time
        )
        if lora is not None or cache_salt is not None:
            prepared = dataclasses.replace(prepared, lora=lora, cache_salt=cache_salt)
        spec = prepared.params.structured_outputs
        if spec is None:
            return prepared
        return dataclasses.replace(prepared, grammar=self.grammars.compile(spec))

    def check_grammar(self, spec: StructuredOutputs) -> None:
        """Compile `spec` (cached) or raise InvalidParameterError naming its param: a part of a
        request's grammar checked on its own, so its errors point inside it. Thread-safe."""
        self.grammars.compile(spec)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """ContextLengthError, without tokenizing, for a prompt of `num_chars` that cannot fit."""
        self.prompts.check_prompt_chars(num_chars, param)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Enter a prepared request into the scheduler, fanned out into n choices."""
        if self.collector.has(prepared.request_id):
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        params = prepared.params
        children = []
        for index in range(params.n):
            child_id = prepared.request_id if params.n == 1 else f"{prepared.request_id}#{index}"
            children.append(
                Request(
                    child_id,
                    prepared.prompt_token_ids,
                    params,
                    max_tokens=prepared.max_tokens,
                    seed=self._choice_seed(params, index),
                    eos_token_ids=self._eos_token_ids,
                    arrival_time=prepared.arrival_time,
                    grammar=None if prepared.grammar is None else prepared.grammar.new_state(),
                    lora=prepared.lora,
                    cache_salt=prepared.cache_salt,
                )
            )
        specs = self.collector.add(prepared.request_id, children)
        if self.output_process is not None:
            self.output_process.add(specs)
        else:
            self.output_processor.add(specs)
        for child in children:
            self.scheduler.add_request(child)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        self.add_prepared(
            self.prepare_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids, lora=lora)
        )

    # ---- LoRA adapters (the registry is AsyncEngine's) -------------------------------------

    def identify_lora(self, path: str) -> tuple[bytes, int]:
        """An adapter directory's digest (its files' bytes) and rank, its files bounded as a load
        bounds them; LoRAAdapterError for what cannot be read. Any thread but the engine's."""
        from kvasir.runtime.loader.lora_adapter import read_adapter_digest

        digest = read_adapter_digest(path, self.model_config, self.config.max_lora_rank)
        return digest, _adapter_rank(path)

    def add_lora(self, lora: LoRARequest) -> None:
        """Read and check the adapter into the worker's host tier; LoRAAdapterError. Any thread
        but the engine's."""
        self.runner.add_lora(lora)

    def remove_lora(self, adapter_id: int) -> None:
        """Forget an adapter in the worker (its requests have all ended); engine thread."""
        self.runner.remove_lora(adapter_id)

    def _choice_seed(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._rng.getrandbits(63)
        # Each choice of an n > 1 request needs its own stream, reproducible from the one seed.
        return (params.seed + index) & _INT64_MASK

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its choices) at any point; its KV blocks are freed at once."""
        children = self.collector.live_children(request_id)
        if not children:
            return
        self.scheduler.finish_requests(
            [child.request_id for child in children], RequestStatus.FINISHED_ABORTED
        )
        self._emit(self.collector.updates(children, None))

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending_outputs)
            or self._in_flight is not None
            or (self.output_process is not None and self.output_process.num_outstanding > 0)
        )

    def close(self) -> None:
        """Stop the engine's helper thread and process; the engine takes no more steps."""
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        if self.output_process is not None:
            self.output_process.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        self.grammars.close()
        self.runner.grammar_masks.close()
        if isinstance(self.runner, MirroredRunner):  # the other tensor-parallel ranks exit with it
            self.runner.stop_ranks()

    # ---- the text side --------------------------------------------------------------------

    def _emit(self, updates: list[ChoiceUpdate]) -> None:
        """Hand a step's choice updates to the text side; its outputs join `_pending_outputs`."""
        if self.output_process is not None:
            if updates:
                self.output_process.submit(updates)
            return
        outputs, stopped = self.output_processor.process(updates)
        self._pending_outputs.extend(outputs)
        self._finish_stopped(stopped)

    def _take_outputs(self, timeout: float = 0.0) -> list[RequestOutput]:
        """The outputs ready now (from the output process, up to `timeout` for the first)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        if self.output_process is not None:
            for step_outputs, stopped in self.output_process.take(timeout):
                outputs.extend(step_outputs)
                self._finish_stopped(stopped)
        return outputs

    def _finish_stopped(self, child_ids: list[str]) -> None:
        """Choices a stop string ended: the scheduler stops them (and frees their blocks)."""
        if child_ids:
            self.collector.finish(child_ids)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_STOPPED)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration: every running request advances, waiting ones join if they fit.

        With async scheduling the next step is planned and queued on the device before this one's
        tokens are read back, so its outputs are those of the step that just completed."""
        if self.executor is not None and not self.drafts.enabled:
            return self._step_overlapped()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return self._take_outputs(timeout=OUTPUT_WAIT_S)
        result = self.runner.execute(plan)
        if self.thread_tuner is not None:
            self.thread_tuner.observe(result.num_tokens, result.duration_s)
        self._complete(plan, result)
        return self._take_outputs()

    def _step_overlapped(self) -> list[RequestOutput]:
        assert self.executor is not None
        current = self._in_flight
        if current is None:
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return self._take_outputs(timeout=OUTPUT_WAIT_S)
            current = _InFlight(plan, self.executor.submit(self.runner.prepare_step(plan)))
        # Plan and queue the next step while this one runs; without a plan (a preemption, or a
        # request whose sampling reads its history) the next call schedules with the tokens known.
        self._in_flight = None
        ahead = self.scheduler.schedule_ahead(current.plan)
        if ahead is not None and not ahead.is_empty:
            self._in_flight = _InFlight(ahead, self.executor.submit(self.runner.prepare_step(ahead)))
        result = current.future.result().result
        self._complete(current.plan, result)
        return self._take_outputs()

    def _complete(self, plan: SchedulerOutput, result: StepResult) -> None:
        """Apply a finished step: tokens to the scheduler, drafts for the next, updates to the
        text side."""
        sampled = dict(zip(result.request_ids, result.token_ids, strict=True))
        updated = self.scheduler.update(plan, sampled, time.monotonic())
        if self.kv_events is not None and self.kv_cache.events is not None:
            self.kv_events.publish(self.kv_cache.events.take())
        if self.drafts.enabled:
            self.drafts.after_step(result, updated, plan.finished_request_ids, self.kv_cache)
        self._emit(self.collector.updates(updated, result))

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.scheduler.num_preemptions_total,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            spec_decode=self.drafts.stats_snapshot(),
            block_size=self.kv_cache.block_size,
            num_gpu_blocks=self.kv_cache.num_blocks,
            cpu_threads=torch_threads() if self.runner.device.type == "cpu" else 0,
            tensor_parallel_size=self.config.tensor_parallel_size,
            structured=self.structured_stats.snapshot(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        if not self.config.enable_lora:
            return {}
        running, waiting = self.scheduler.lora_adapters()
        return {
            "running_loras": tuple(running),
            "waiting_loras": tuple(waiting),
            "max_loras": self.config.max_loras,
        }

    # ---- offline convenience --------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_finish: Callable[[GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """Run a whole batch to completion; results come back in the order of `prompts`.

        `on_finish` is called as each request finishes (progress bars)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        results: dict[str, GenerationResult] = {}
        order = []
        for index, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
            request_id = f"generate-{index}"
            if isinstance(prompt, str):
                prepared = self.prepare_request(request_id, prompt, request_params)
            else:
                prepared = self.prepare_request(request_id, None, request_params, prompt_token_ids=prompt)
            self.add_prepared(prepared)
            order.append(request_id)
            results[request_id] = GenerationResult(
                request_id,
                len(prepared.prompt_token_ids),
                [Completion(i) for i in range(request_params.n)],
            )
        while self.has_unfinished():
            for output in self.step():
                for delta in output.outputs:
                    results[output.request_id].choices[delta.index].add(delta)
                if output.finished and on_finish is not None:
                    on_finish(results[output.request_id])
        return [results[request_id] for request_id in order]


def _adapter_rank(path: str) -> int:
    """`r` of an adapter's adapter_config.json (already read once, bounded, by the digest); the
    worker's load checks the whole config again, and that this rank is the one it reads."""
    from kvasir.runtime.loader.lora_adapter import CONFIG_FILE, MAX_CONFIG_BYTES
    from kvasir.runtime.lora.errors import LoRAAdapterError

    try:
        with open(os.path.join(path, CONFIG_FILE), "rb") as file:
            config = json.loads(file.read(MAX_CONFIG_BYTES + 1)[:MAX_CONFIG_BYTES])
    except (OSError, ValueError, RecursionError):
        raise LoRAAdapterError(f"{CONFIG_FILE}: cannot be read as a JSON object") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{CONFIG_FILE}: 'r' must be a positive integer, got {rank!r}")
    return rank


@dataclass(frozen=True)
class _InFlight:
    """A step queued on the executor and the plan it runs."""

    plan: SchedulerOutput
    future: Future[StepOutcome]
