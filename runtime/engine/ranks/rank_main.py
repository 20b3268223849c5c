"""A rank process (ranks 1..N-1): join the groups, build the model runner, apply rank 0's calls.

Started by `supervisor.py` (in the serving process, or in a worker node's agent) with the spawn
context (a fresh interpreter: no forked torch threads or CUDA state). Its one pipe to its parent
carries, upwards, its start-up stages ("joining", "ready"), a start-up error, and a heartbeat every
`HEARTBEAT_INTERVAL_S`; the parent never writes to it, so the pipe reading ready means the
parent's end closed: the parent is gone, and this process exits at once (a rank must never
outlive the process that started it; a parent-death signal would not do, since it fires when the
spawning *thread* exits). Rank 0's calls arrive on the CPU group instead
(`parallel/call_channel.py`).
The top-level imports are light on purpose: the watcher runs before torch is imported.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

HEARTBEAT_INTERVAL_S = 0.5


class _Pipe:
    """The rank's end of its pipe, shared by the watcher and the main thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except OSError:  # rank 0's end is closed: it is gone
                os._exit(1)

    def watch(self) -> None:
        """Beat until rank 0's end closes (poll() turns true on EOF: rank 0 sends nothing)."""
        while not self._conn.poll(HEARTBEAT_INTERVAL_S):
            self.send(("beat",))
        os._exit(1)


def run_rank(
    rank: int,
    device_index: int,
    size: int,
    host: str,
    port: int,
    config: Any,
    threads: int | None,
    conn: Connection,
) -> None:
    """The process's target: never returns normally (exit 0 after Stop, 1 on any error). It joins
    the group at `host:port`; `device_index` is its GPU on this machine."""
    # Ctrl-C in a terminal reaches the whole process group: rank 0 alone handles it (it drains,
    # then stops the ranks); a rank interrupted on its own would only turn the drain into a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Rank 0 logs the group's story; a rank's own warnings and errors go to the same stderr (the
    # pod's log), marked with the rank that wrote them.
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    pipe = _Pipe(conn)
    threading.Thread(target=pipe.watch, name=f"kvasir-rank{rank}-watch", daemon=True).start()
    try:
        _serve(rank, device_index, size, host, port, config, threads, pipe)
    except BaseException as error:
        traceback.print_exc()
        pipe.send(("error", f"{type(error).__name__}: {error}"))
        os._exit(1)
    os._exit(0)


def _serve(
    rank: int,
    device_index: int,
    size: int,
    host: str,
    port: int,
    config: Any,
    threads: int | None,
    pipe: _Pipe,
) -> None:
    import torch

    from kvasir.runtime.engine.ranks.calls import RankState
    from kvasir.runtime.loader.model_files import open_engine_model
    from kvasir.runtime.parallel.call_channel import CallChannel
    from kvasir.runtime.parallel.init import join_group, startup_timeout
    from kvasir.runtime.worker.model_runner import ModelRunner, resolve_device

    if threads is not None:
        torch.set_num_threads(threads)
    device = resolve_device(config.device)
    pipe.send(("joining",))
    timeout = startup_timeout(config.distributed_timeout_seconds)
    parallel = join_group(rank, size, port, device.type, timeout, host=host, device_index=device_index)
    runner = ModelRunner(config, open_engine_model(config), parallel=parallel)
    pipe.send(("ready",))
    state, calls = RankState(runner), CallChannel(parallel)
    while not state.stopped:
        calls.receive().apply(state)
