"""The text side of the engine in a process of its own: detokenizing, stop strings and building
outputs run there, so the engine's process spends its GIL on scheduling and launching steps
(vLLM detokenizes in its API server process, SGLang in a detokenizer process).

The engine sends each step's `ChoiceUpdate`s down one pipe and a reader thread collects the
`RequestOutput`s coming back up the other, so neither side can block the other on a full pipe.
Outputs arrive a little after the step that made them; a stop string found here comes back as a
list of choices for the engine to finish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from kvasir.runtime.engine.output.processor import OutputProcessor
from kvasir.runtime.engine.output.updates import ChoiceSpec, ChoiceUpdate
from kvasir.runtime.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

StepOutputs = tuple[list[RequestOutput], list[str]]  # outputs, choices a stop string ended


class OutputProcessError(RuntimeError):
    """The output process failed or went away; no more outputs will come."""


class OutputProcess:
    """A child process running an `OutputProcessor` over the tokenizer `tokenizer_json`."""

    def __init__(self, tokenizer_json: str) -> None:
        # A fresh interpreter (not multiprocessing's spawn, which re-runs the parent's __main__
        # script): two pipes, the ends it needs inherited by number.
        child_in, to_child = os.pipe()
        from_child, child_out = os.pipe()
        command = [
            sys.executable,
            "-m",
            "kvasir.runtime.engine.output.process",
            str(child_in),
            str(child_out),
        ]
        self._process = subprocess.Popen(command, pass_fds=(child_in, child_out), stdin=subprocess.DEVNULL)
        os.close(child_in)
        os.close(child_out)
        self._to_child = Connection(to_child, readable=False)
        self._from_child = Connection(from_child, writable=False)
        self._send(tokenizer_json)
        self._results: queue.SimpleQueue[StepOutputs | BaseException] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="kvasir-output-reader", daemon=True)
        self._reader.start()
        self.num_outstanding = 0  # steps sent whose outputs have not been taken yet

    def add(self, specs: list[ChoiceSpec]) -> None:
        self._send(("add", specs))

    def submit(self, updates: list[ChoiceUpdate]) -> None:
        self.num_outstanding += 1
        self._send(("step", updates))

    def take(self, timeout: float = 0.0) -> list[StepOutputs]:
        """Every step's outputs that came back; waits up to `timeout` for the first one."""
        taken: list[StepOutputs] = []
        wait: float | None = timeout
        while self.num_outstanding:
            try:
                item = self._results.get(timeout=wait) if wait else self._results.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, BaseException):
                raise OutputProcessError(f"the output process failed: {item}") from item
            taken.append(item)
            self.num_outstanding -= 1
            wait = None
        return taken

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(OutputProcessError):
                self._send(None)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        if not self._to_child.closed:
            self._to_child.close()

    def _send(self, message: Any) -> None:
        try:
            self._to_child.send(message)
        except (BrokenPipeError, OSError) as error:
            raise OutputProcessError(f"the output process went away: {error}") from error

    def _read(self) -> None:
        while True:
            try:
                message = self._from_child.recv()
            except (EOFError, OSError) as error:
                self._results.put(OutputProcessError(f"the output process exited ({error!r})"))
                return
            if isinstance(message, str):  # the child's error, already formatted
                self._results.put(OutputProcessError(message))
                return
            self._results.put(message)


def _serve(inbox: Connection, outbox: Connection) -> None:
    """The child's loop: the tokenizer, then specs in and outputs out, until None or EOF."""
    from tokenizers import Tokenizer

    try:
        processor = OutputProcessor(Tokenizer.from_str(inbox.recv()))
        while True:
            message = inbox.recv()
            if message is None:
                return
            kind, payload = message
            if kind == "add":
                processor.add(payload)
            else:
                outbox.send(processor.process(payload))
    except EOFError:
        return  # the engine went away
    except BaseException as error:  # report, then stop: the engine raises it on its next take()
        outbox.send(f"{type(error).__name__}: {error}")
        raise


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the engine decides when this process stops (it
    # closes the pipe, or sends None), so the interrupt is left to the engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
