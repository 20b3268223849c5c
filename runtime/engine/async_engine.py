"""AsyncEngine: the LLMEngine on its own thread, with an async iterator of outputs per request.

The engine loop runs off the event loop so HTTP handlers, `/health` and streaming stay responsive
while a step runs. Requests are validated and tokenized on the caller's side (errors surface at
once, as exceptions of `generate`); the loop thread only moves prepared requests and aborts into
the engine between steps, so the engine itself is never touched by two threads.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvasir.runtime.engine.llm_engine import EngineStats, LLMEngine, PreparedRequest
from kvasir.runtime.engine.lora_registry import LoRALease, LoRARegistry, LoRARegistryError
from kvasir.runtime.engine.outputs import RequestOutput
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.lora.hub import download_adapter
from kvasir.runtime.lora.modules import HubAdapter
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.outputs import WeightsReport
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.structured.params import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _RemoveLoRA:
    adapter_id: int


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception in a step, or shutdown); no request can progress."""


class AsyncEngine:
    """Thread-backed async front of an LLMEngine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[PreparedRequest | _Abort | _RemoveLoRA | None] = queue.SimpleQueue()
        self._streams: dict[
            str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._streams_lock = threading.Lock()
        self._stats = engine.stats()
        self._error: BaseException | None = None
        # The served adapters (None without --enable-lora). Loads run on their own thread, one at a
        # time (off the event loop and off the engine thread); removals go through the commands,
        # so they reach the engine after the aborts of the adapter's last requests.
        self.loras = (
            LoRARegistry(
                engine.config.model_name,
                identify=engine.identify_lora,
                add=engine.add_lora,
                remove=lambda adapter_id: self._commands.put(_RemoveLoRA(adapter_id)),
                # The model's cache and token: an adapter's download is the model's, two files only.
                download=functools.partial(
                    download_adapter, download_dir=engine.config.download_dir, token=engine.config.hf_token
                ),
            )
            if engine.config.enable_lora
            else None
        )
        self._lora_loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvasir-lora-load")
        self._dead_callbacks: list[Callable[[BaseException], object]] = []
        self._dead_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvasir-engine", daemon=True)
        self._thread.start()
        # A tensor-parallel rank that dies or hangs ends the engine from the rank monitor's thread:
        # the engine's own thread may be the one stuck in a collective with it.
        engine.on_rank_failure(self._fail)

    # ---- public API (event-loop side) ------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs; leaving the iterator early aborts the request."""
        prepared = self.engine.prepare_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids)
        async for output in self.generate_prepared(prepared):
            yield output

    async def generate_prepared(self, prepared: PreparedRequest) -> AsyncGenerator[RequestOutput, None]:
        if self._error is not None:
            raise EngineDeadError("the engine loop has stopped") from self._error
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._streams_lock:
            if prepared.request_id in self._streams:
                raise ValueError(f"request id {prepared.request_id!r} is already in use")
            self._streams[prepared.request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(prepared)
        if self._error is not None:  # died between the check above and the stream's registration
            with self._streams_lock:
                self._streams.pop(prepared.request_id, None)
            raise EngineDeadError("the engine loop has stopped") from self._error
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            # Client gone (cancelled, disconnected) or an error: abort frees the KV blocks.
            with self._streams_lock:
                self._streams.pop(prepared.request_id, None)
            if not finished:
                self._commands.put(_Abort(prepared.request_id))

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
        """Validate and tokenize (thread-safe); `arrival_time` (time.monotonic()) starts the latency
        clocks; `lora` is the adapter the request runs with; `cache_salt` keys its prefix cache."""
        return self.engine.prepare_request(
            request_id,
            prompt,
            params,
            prompt_token_ids=prompt_token_ids,
            arrival_time=arrival_time,
            lora=lora,
            cache_salt=cache_salt,
        )

    # ---- LoRA adapters ----------------------------------------------------------------------

    @property
    def max_loras(self) -> int:
        """Adapter slots per step (0: LoRA off)."""
        return self.engine.config.max_loras if self.loras is not None else 0

    def lora_adapters(self) -> list[LoRARequest]:
        """The adapters serving now, in load order (none without --enable-lora)."""
        return [] if self.loras is None else self.loras.adapters()

    def acquire_lora(self, name: str) -> LoRALease | None:
        """A hold on the adapter serving as `name` for one request (release it when the request
        ends), or None when no adapter serves under that name."""
        return None if self.loras is None else self.loras.acquire(name)

    async def load_lora(
        self, name: str, path: str | HubAdapter, *, replace: bool = False
    ) -> tuple[LoRARequest, float]:
        """Load an adapter (a hub adapter downloaded, its files read and checked, all on the loader
        thread); returns it and the seconds the load took. LoRARegistryError (with its HTTP
        status), LoRAAdapterError (400) or, for a hub adapter, the loader's ModelLoadError kinds."""
        registry = self._registry()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._lora_loader, functools.partial(registry.load, name, path, replace=replace)
        )

    async def unload_lora(self, name: str, timeout: float) -> LoRARequest:
        """Stop serving `name` now, wait up to `timeout` seconds for its requests, then remove it;
        LoRANotFoundError (404), or LoRAConflictError (409) when requests outlast the bound."""
        registry = self._registry()
        entry = registry.begin_unload(name)
        return await asyncio.to_thread(registry.wait_unloaded, entry, timeout)

    def _registry(self) -> LoRARegistry:
        if self.loras is None:
            raise LoRARegistryError("LoRA adapters are off: start the server with --enable-lora.")
        return self.loras

    def check_grammar(self, spec: StructuredOutputs) -> None:
        """Compile a grammar (cached) or raise InvalidParameterError naming its param; thread-safe,
        never on the event loop (a compile may take up to its deadline)."""
        self.engine.check_grammar(spec)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # The model's facts, fixed at load time: safe to read from any thread.
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def weights_report(self) -> WeightsReport:
        """What the weights were loaded as (format, kernels, bytes)."""
        return self.engine.weights_report

    @property
    def startup_seconds(self) -> dict[str, float]:
        """How long each phase of building the engine took (model files, weights, KV cache, ...)."""
        return dict(self.engine.startup.seconds)

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (read without touching the engine)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def on_dead(self, callback: Callable[[BaseException], object]) -> None:
        """Call `callback(error)` once, from whichever thread sees it, when the engine stops with an
        error (a failed step, a dead rank); at once if it already has. Not after a shutdown."""
        with self._dead_lock:
            error = self._error
            if error is None:
                self._dead_callbacks.append(callback)
        if error is not None:
            callback(error)

    def _fail(self, error: BaseException) -> None:
        """Mark the engine dead now: every waiting stream gets the error, the loop stops when it can."""
        with self._dead_lock:
            if self._error is not None:
                return
            self._error = error
            callbacks, self._dead_callbacks = self._dead_callbacks, []
        self._commands.put(None)  # wakes an idle loop; a loop inside a step stops after it
        self._fail_streams(f"engine loop failed: {error}")
        for callback in callbacks:
            callback(error)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._lora_loader.shutdown(wait=False, cancel_futures=True)
        self._commands.put(None)
        self._thread.join(timeout)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block for work only when the engine is idle; otherwise drain what arrived.
                block = not engine.has_unfinished()
                if not self._apply_commands(block=block):
                    return
                if engine.has_unfinished():
                    self._deliver_step(engine.step())
                self._stats = engine.stats()
        except BaseException as error:
            logger.exception("engine loop failed")
            self._fail(error)
        finally:
            engine.close()
            # Nothing will progress any more: wake every waiting stream instead of leaving it hanging.
            self._fail_streams(f"engine loop failed: {self._error}" if self._error else "engine shut down")

    def _fail_streams(self, reason: str) -> None:
        with self._streams_lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(request_id, EngineDeadError(reason))

    def _apply_commands(self, *, block: bool) -> bool:
        """Move queued adds/aborts into the engine; False when asked to shut down."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            if isinstance(command, _Abort):
                self.engine.abort(command.request_id)
            elif isinstance(command, _RemoveLoRA):
                self.engine.remove_lora(command.adapter_id)
            else:
                try:
                    self.engine.add_prepared(command)
                except Exception as error:
                    self._deliver(command.request_id, error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop, not one per request."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:  # else the consumer left; its abort is already queued
                    batches.setdefault(stream[0], []).append((stream[1], output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return  # the consumer left; its abort is already queued
        loop, outputs = stream
        loop.call_soon_threadsafe(outputs.put_nowait, item)


def _put_all(batch: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    for outputs, output in batch:
        outputs.put_nowait(output)
