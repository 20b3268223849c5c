"""Runs prepared steps on a thread of their own, one after another, so the engine's thread can
plan and prepare the next step while the accelerator works on this one (async scheduling).

The thread does only the device's share of a step (`ModelRunner.run_prepared`): moving inputs,
the forward pass and the sampler. A step whose inputs include placeholder tokens reads them from
the tensor its predecessor sampled, so consecutive decode steps never wait for the host. On a GPU
the kernels run asynchronously anyway; the thread is what lets the next step's launch follow the
previous one's at once while the engine's thread is busy in Python (SGLang's overlap scheduler
uses a forward thread the same way). Torch releases the GIL inside its kernels, so the two
threads overlap on a CPU too.
"""

from __future__ import annotations

import queue
import sys
import threading
from concurrent.futures import Future

from kvasir.runtime.worker.model_runner import ModelRunner, PreparedStep, StepOutcome

# How long a thread may keep the GIL while another waits for it. CPython's default, 5 ms, is a
# whole decode step: the executor, back from the device and needing the GIL for a few
# microseconds, would wait behind the engine thread's Python for up to that long. Measured with
# benchmarks/host_overlap.py (batch 256): 5 ms -> 16.7 ms per step, 0.5 ms -> 13.5, 0.2 ms -> 11.1.
GIL_SWITCH_INTERVAL_S = 2e-4


class StepExecutor:
    """A FIFO of prepared steps, run in order by one daemon thread."""

    def __init__(self, runner: ModelRunner) -> None:
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._runner = runner
        self._jobs: queue.SimpleQueue[tuple[PreparedStep, Future[StepOutcome]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvasir-step-executor", daemon=True)
        self._thread.start()

    def submit(self, step: PreparedStep) -> Future[StepOutcome]:
        """Queue `step` after those already submitted; its placeholders read the one before it."""
        future: Future[StepOutcome] = Future()
        self._jobs.put((step, future))
        return future

    def stop(self) -> None:
        """Let the thread exit once the steps already queued have run."""
        self._jobs.put(None)

    def shutdown(self) -> None:
        self.stop()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        previous: StepOutcome | None = None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, future = job
            try:
                outcome = self._runner.run_prepared(step, previous)
            except BaseException as error:  # the engine's thread re-raises it from the future
                future.set_exception(error)
                previous = None
                continue
            future.set_result(outcome)
            previous = outcome
