"""`kvasir serve` with timestamps at each hand-off of a token, for benchmarks/serving_timeline.py.

Not a benchmark itself. It wraps four functions of the serving path (the model runner's step, the
engine's step, the event loop's delivery of a step's outputs, the SSE encoding of a chunk) so each
records `time.monotonic()` when it ends (the runner also when it starts), then runs `kvasir serve`
with the given arguments. At exit the timestamps are written as JSON to `KVASIR_TIMELINE_FILE`.
CLOCK_MONOTONIC is one clock for every process on a Linux host, so the client's receive times
line up with these.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

STAMPS: dict[str, list[float]] = {
    "execute_start": [], "execute_end": [], "step_end": [], "delivered": [], "encoded": [],
}  # fmt: skip


def stamped(function: Callable[..., Any], end: str, start: str | None = None) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if start is not None:
            STAMPS[start].append(time.monotonic())
        result = function(*args, **kwargs)
        STAMPS[end].append(time.monotonic())
        return result

    return wrapper


def install() -> None:
    from kvasir.runtime.engine import async_engine, llm_engine
    from kvasir.runtime.server import streaming
    from kvasir.runtime.worker import model_runner

    runner = model_runner.ModelRunner
    runner.execute = stamped(runner.execute, "execute_end", "execute_start")  # type: ignore[method-assign]
    llm_engine.LLMEngine.step = stamped(llm_engine.LLMEngine.step, "step_end")  # type: ignore[method-assign]
    async_engine._put_all = stamped(async_engine._put_all, "delivered")  # type: ignore[attr-defined]
    streaming.sse_event = stamped(streaming.sse_event, "encoded")  # type: ignore[attr-defined]


def write() -> None:
    with open(os.environ["KVASIR_TIMELINE_FILE"], "w") as out:
        json.dump(STAMPS, out)


if __name__ == "__main__":
    install()
    atexit.register(write)
    from kvasir.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
