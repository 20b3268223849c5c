"""What the handlers share (kept on `app.state.kvasir`): the engine, its loading, metrics, tracing, admission.

The engine is built on a daemon thread started by the app's lifespan, so the port is open and
`/health` answers while a large model loads; `/ready` turns true only after a warm-up request has
run through the whole path (tokenizer, scheduler, model, sampler, detokenizer).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import TYPE_CHECKING, Any, TypeVar

from kvasir.runtime.allocator import release_free_memory
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.async_engine import AsyncEngine
from kvasir.runtime.engine.llm_engine import PreparedRequest
from kvasir.runtime.engine.lora_registry import LoRALease
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.lora.modules import HubAdapter, is_hub_path, parse_hub_adapter
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.server.chat_size import check_message_count, min_tokens_per_message
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.errors import APIError
from kvasir.runtime.server.generation import Generation
from kvasir.runtime.server.lifecycle import Lifecycle
from kvasir.runtime.server.logprobs import TokenTexts
from kvasir.runtime.server.logs import RequestLog
from kvasir.runtime.server.metrics import ServerMetrics, process_start_time
from kvasir.runtime.server.protocol import ChatMessage
from kvasir.runtime.server.tracing import RequestTracer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Between the engine's death and the exit: the failed streams' last bytes reach their clients, and
# a probe or a log collector sees the 503 and the reason before the port closes.
ENGINE_DEAD_EXIT_DELAY_S = 3.0
EngineFactory = Callable[[], AsyncEngine]


class ServerState:
    """The engine (None until loaded) and the server-wide services around it."""

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ServerConfig,
        engine_factory: EngineFactory,
        *,
        tracer_provider: TracerProvider | None = None,
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine_config = engine_config
        self.config = config
        self.model_name = engine_config.model_name
        self.created = int(time.time())
        self.engine: AsyncEngine | None = None
        self._token_texts: TokenTexts | None = None
        self.min_message_tokens = 0  # what the chat template adds per message, at least (chat_size.py)
        self.metrics = ServerMetrics(
            self.model_name,
            lambda: self.engine.stats() if self.engine else None,
            lambda: self.engine.weights_report if self.engine else None,
        )
        self.lifecycle = Lifecycle(
            max_running=engine_config.max_num_seqs,
            max_queue_len=config.max_queue_len,
            retry_after=config.retry_after,
            on_reject=self.metrics.rejected,
        )
        self.tracer = RequestTracer(tracer_provider) if tracer_provider is not None else None
        self._engine_factory = engine_factory
        self._on_fatal = on_fatal
        # Tokenizing and chat rendering run here, off the event loop, at most two at a time: a burst
        # of long prompts queues for these threads instead of taking every core from the engine.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvasir-tokenize")

    async def off_loop(self, function: Callable[[], T]) -> T:
        """Run CPU-bound request work (tokenizing, rendering) on the bounded tokenizer pool."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, function)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """400 at once for a text too long to fit the context, before any tokenizing."""
        self.loaded_engine().engine.check_prompt_chars(num_chars, param)

    def check_chat_size(self, messages: Sequence[ChatMessage]) -> None:
        """400 at once for messages too many or too long to fit the context, before any rendering."""
        check_message_count(len(messages), self.min_message_tokens, self.loaded_engine().max_model_len)
        self.check_prompt_chars(sum(message.content_chars() for message in messages), "messages")

    # ---- loading -------------------------------------------------------------------------------

    async def load(self) -> None:
        """Build the engine off the event loop, warm it up, then turn ready; on failure, call on_fatal.
        The time each phase took is a metric: the autoscaler learns its cold start from it."""
        loading = time.time()
        try:
            engine = await _in_daemon_thread(self._engine_factory)
            self.engine = engine
            loop = asyncio.get_running_loop()
            engine.on_dead(lambda error: loop.call_soon_threadsafe(self._engine_died, error))
            await self.load_lora_modules(engine)
            built = time.time()
            await self._warm_up(engine)
            self.min_message_tokens = await self.off_loop(lambda: min_tokens_per_message(engine.tokenizer))
            release_free_memory()  # what loading freed, before the steps' own peak adds to it
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the model could not be loaded")
            self.lifecycle.set_failed()
            self._on_fatal()
            return
        ready = time.time()
        started = process_start_time() or loading
        # The engine's own phases (model files, weights, KV cache, kernel warm-up, CUDA graphs), and
        # what the rest of its build took (scheduler, output process, event publisher).
        measured = engine.startup_seconds
        phases = {
            "process": loading - started,
            **measured,
            "engine_setup": max(built - loading - sum(measured.values()), 0.0),
            "warmup": ready - built,
        }
        self.metrics.ready_after({**phases, "total": ready - started})
        self.lifecycle.set_ready()
        logger.info(
            "ready: serving %s (max_model_len %d) %.1fs after the process started (%s)",
            self.model_name,
            engine.max_model_len,
            ready - started,
            ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in phases.items()),
        )

    def _engine_died(self, error: BaseException) -> None:
        """A dead engine never recovers (a failed step, a tensor-parallel rank gone): /health says
        503 at once, and after `ENGINE_DEAD_EXIT_DELAY_S` the process exits non-zero, so the
        orchestrator restarts it without waiting for its liveness probe to fail repeatedly."""
        logger.error("the engine is dead (%s); exiting in %g s", error, ENGINE_DEAD_EXIT_DELAY_S)
        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, self._on_fatal)

    async def _warm_up(self, engine: AsyncEngine) -> None:
        tokenizer = engine.tokenizer
        token_ids = tokenizer.encode("Hello", add_special_tokens=False)[:1] or [tokenizer.bos_token_id or 0]
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
        async for _ in engine.generate("kvasir-warmup", params=params, prompt_token_ids=token_ids):
            pass

    async def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    # ---- per request ---------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served name, a LoRA adapter serving now, or omitted."""
        if model is None or model == self.model_name:
            return
        lease = self.lease_model(model)
        if lease is not None:
            lease.release()

    def lease_model(self, model: str | None) -> LoRALease | None:
        """The adapter `model` names, held for one request (release the lease when it ends), or None
        for the base model (its name, or none given); 404 `model_not_found` for anything else, 503
        while the model loads (the adapters are not known before)."""
        if model is None or model == self.model_name:
            return None
        engine = self.loaded_engine() if self.engine_config.enable_lora else self.engine
        lease = engine.acquire_lora(model) if engine is not None else None
        if lease is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`"
                + (" and its LoRA adapters (GET /v1/models)." if self.engine_config.enable_lora else "."),
                param="model",
                code="model_not_found",
            )
        return lease

    async def load_lora_modules(self, engine: AsyncEngine) -> None:
        """Load the adapters of --lora-modules (start-up: any failure stops the server loading)."""
        if self.config.lora_modules and not self.engine_config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for module in self.config.lora_modules:
            if module.base_model_name not in (None, self.model_name):
                raise ValueError(
                    f"--lora-modules: adapter {module.name!r} is for {module.base_model_name!r}, "
                    f"this server serves {self.model_name!r}"
                )
            path: str | HubAdapter
            if is_hub_path(module.path):
                path = parse_hub_adapter(module.path, module.revision)  # checked by the flag's parser
            else:
                path = os.path.realpath(module.path)
            try:
                _, seconds = await engine.load_lora(module.name, path)
            except (ValueError, ModelLoadError) as error:
                raise ValueError(f"--lora-modules: adapter {module.name!r}: {error}") from None
            self.metrics.lora_loaded(seconds)

    def require_engine(self) -> AsyncEngine:
        """The engine, or 503 while loading or draining."""
        self.lifecycle.check_open()
        return self.loaded_engine()

    def loaded_engine(self) -> AsyncEngine:
        """The engine once loaded (draining or not), or 503 while loading."""
        if self.engine is None:
            raise APIError(503, "The model is still loading; retry shortly.", code="loading")
        return self.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded_engine().tokenizer

    @property
    def token_texts(self) -> TokenTexts:
        """Per-token text for logprobs, shared across requests (its cache is bounded by the vocabulary)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.tokenizer)
        return self._token_texts

    async def prepare(
        self,
        engine: AsyncEngine,
        response_id: str,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        *,
        arrival: float,
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> list[PreparedRequest]:
        """Validate and tokenize each prompt off the loop (token ids are checked against the vocabulary
        here, before anything decodes them); raises 400s naming the field. `lora`: the adapter they
        run with; `cache_salt`: the client's prefix-cache salt."""
        ids = [response_id] if len(prompts) == 1 else [f"{response_id}-{i}" for i in range(len(prompts))]

        def prepare() -> list[PreparedRequest]:
            prepared = []
            for request_id, prompt in zip(ids, prompts, strict=True):
                text, token_ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
                prepared.append(
                    engine.prepare_request(
                        request_id,
                        text,
                        params,
                        prompt_token_ids=token_ids,
                        arrival_time=arrival,
                        lora=lora,
                        cache_salt=cache_salt,
                    )
                )
            return prepared

        return await self.off_loop(prepare)

    def admit(
        self,
        engine: AsyncEngine,
        response_id: str,
        operation: str,
        prepared: Sequence[PreparedRequest],
        *,
        headers: Mapping[str, str],
        log: RequestLog | None,
        span_attributes: Mapping[str, Any],
        lora_lease: LoRALease | None = None,
    ) -> Generation:
        """Admit prepared requests (503 draining, 429 full) and return their generation, which
        releases `lora_lease` (the adapter they run with) when it ends."""
        n = prepared[0].params.n
        generation = Generation(engine, response_id, prepared, n, self.metrics, log, prepared[0].arrival_time)
        generation.ticket = self.lifecycle.admit(response_id, len(prepared) * n, generation.abort)
        if lora_lease is not None:
            generation.lora_lease = lora_lease
            self.metrics.lora_request(lora_lease.lora.name)
        if self.tracer is not None:
            span = self.tracer.start(operation, self.model_name, headers, span_attributes, generation.arrival)
            generation.trace(self.tracer, span)
        return generation


async def _in_daemon_thread(function: Callable[[], T]) -> T:
    """Run `function` on a daemon thread: a shutdown during a long load must not wait for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = function(), None
        except BaseException as caught:
            result, error = None, caught
        with suppress(RuntimeError):  # the event loop is gone: the server stopped while loading
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="kvasir-load", daemon=True).start()
    return await future
