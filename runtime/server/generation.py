"""One HTTP request's run through the engine: its prompts' outputs merged, metrics, span, log, capacity.

`outputs()` yields `(prompt_index, RequestOutput)` for every prompt of the request. However it ends
(finished, client gone, error, drain abort), its `finally` settles the accounting exactly once:
leaving the iterator early aborts the engine requests (which frees their KV blocks), unfinished
choices are counted as aborted, the span is closed and the admission ticket is released.

Each choice's timing record is built here from its deltas as they arrive (`record_times`), and a
choice is counted in the metrics once, when it ends: on its finishing delta, whoever ended it
(engine, stop string, abort), or, with the client gone before that delta, at settle time. So every
finish has the latencies the choice took part in, by the same path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

from kvasir.runtime.engine.async_engine import AsyncEngine
from kvasir.runtime.engine.llm_engine import PreparedRequest
from kvasir.runtime.engine.lora_registry import LoRALease
from kvasir.runtime.engine.outputs import Completion, RequestOutput, RequestTimes, record_times
from kvasir.runtime.server.lifecycle import Ticket
from kvasir.runtime.server.logs import RequestLog
from kvasir.runtime.server.metrics import ServerMetrics
from kvasir.runtime.server.responses import PromptTokensDetails, Usage
from kvasir.runtime.server.tracing import RequestSummary, RequestTracer

if TYPE_CHECKING:
    from opentelemetry.trace import Span

_DONE = object()  # a merged prompt's stream ended


class Generation:
    """The engine requests of one HTTP request (one per prompt, each with n choices)."""

    def __init__(
        self,
        engine: AsyncEngine,
        response_id: str,
        prepared: Sequence[PreparedRequest],
        n: int,
        metrics: ServerMetrics,
        log: RequestLog | None,
        arrival: float,
    ) -> None:
        self.response_id = response_id
        self.prepared = list(prepared)
        self.n = n
        self.arrival = arrival
        self.ticket: Ticket | None = None
        self.lora_lease: LoRALease | None = None  # the adapter's hold, released when the answer ends
        self.num_cached_tokens = 0
        self._engine = engine
        self._metrics = metrics
        self._log = log
        self._tracer: RequestTracer | None = None
        self._span: Span | None = None
        self._output_tokens = 0
        # Per (prompt index, choice index): the timing record so far, and the finish reason once ended.
        self._times: dict[tuple[int, int], RequestTimes] = {}
        self._finished: dict[tuple[int, int], str] = {}
        self._error: str | None = None
        self._settled = False
        if log is not None:
            log.request_id = response_id

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prepared)

    @property
    def output_tokens(self) -> int:
        return self._output_tokens

    def usage(self) -> Usage:
        """OpenAI `usage`: prompt tokens once per prompt, completion tokens over every choice."""
        prompt, completion = self.prompt_tokens, self._output_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )

    def trace(self, tracer: RequestTracer, span: Span) -> None:
        self._tracer, self._span = tracer, span

    def abort(self) -> None:
        """Abort every engine request of this generation (the drain timeout); streams then end."""
        for prepared in self.prepared:
            self._engine.abort(prepared.request_id)

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        try:
            if len(self.prepared) == 1:
                async with aclosing(self._engine.generate_prepared(self.prepared[0])) as stream:
                    async for output in stream:
                        self._observe(0, output)
                        yield 0, output
            else:
                async with aclosing(self._merged()) as merged:
                    async for index, output in merged:
                        self._observe(index, output)
                        yield index, output
        except Exception as error:
            self._error = f"{type(error).__name__}: {error}"
            raise
        finally:
            self._settle()

    async def collect(self) -> list[list[Completion]]:
        """Run to the end; returns each prompt's choices, accumulated from their deltas."""
        choices = [[Completion(i) for i in range(self.n)] for _ in self.prepared]
        async with aclosing(self.outputs()) as outputs:
            async for index, output in outputs:
                for delta in output.outputs:
                    choices[index][delta.index].add(delta)
        return choices

    async def _merged(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Several prompts' streams as one, in arrival order; closing it cancels (aborts) them all."""
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def pump(index: int, prepared: PreparedRequest) -> None:
            try:
                async for output in self._engine.generate_prepared(prepared):
                    queue.put_nowait((index, output))
            except Exception as error:
                queue.put_nowait((index, error))
            finally:
                queue.put_nowait((index, _DONE))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(self.prepared)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                elif isinstance(item, RequestOutput):
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _observe(self, prompt_index: int, output: RequestOutput) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        for delta in output.outputs:
            key = (prompt_index, delta.index)
            record_times(self._times_of(key), delta)
            if delta.token_ids:
                self._output_tokens += len(delta.token_ids)
                self._metrics.add_generation_tokens(len(delta.token_ids))
            if delta.finish_reason is not None:
                self._finish(key, delta.finish_reason)

    def _times_of(self, key: tuple[int, int]) -> RequestTimes:
        times = self._times.get(key)
        if times is None:
            times = self._times[key] = RequestTimes(arrival=self.arrival)
        return times

    def _finish(self, key: tuple[int, int], reason: str) -> None:
        """Count a choice's end once, with its record; a choice ended here (the client left, an
        error) ends now."""
        if key in self._finished:
            return
        times = self._times_of(key)
        if times.finished is None:
            times.finished = time.monotonic()
        self._finished[key] = reason
        self._metrics.finished(reason, times)

    def close(self) -> None:
        """Settle the accounting if `outputs()` never ran to its end (or never started); idempotent."""
        self._settle()

    def _settle(self) -> None:
        """Account for the request once, however it ended."""
        if self._settled:
            return
        self._settled = True
        for prompt_index in range(len(self.prepared)):
            for choice in range(self.n):
                self._finish((prompt_index, choice), "abort")  # no-op for choices already ended
        self._metrics.add_prompt_tokens(self.prompt_tokens)
        reasons = list(self._finished.values())
        if self._log is not None:
            self._log.prompt_tokens = self.prompt_tokens
            self._log.completion_tokens = self._output_tokens
            self._log.finish_reason = ",".join(sorted(set(reasons)))
        if self._tracer is not None and self._span is not None:
            summary = RequestSummary(
                response_id=self.response_id,
                prompt_tokens=self.prompt_tokens,
                output_tokens=self._output_tokens,
                finish_reasons=tuple(reasons),
                times=tuple(self._times[key] for key in self._finished),
                error=self._error,
            )
            self._tracer.finish(self._span, summary, self.arrival)
        if self.ticket is not None:
            self.ticket.release()
        if self.lora_lease is not None:
            self.lora_lease.release()
