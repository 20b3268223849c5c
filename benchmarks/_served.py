"""A real `kvasir serve` on loopback for the simulator's benchmarks, and a streaming client."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def served(
    model: str,
    max_model_len: int,
    kv_cache_bytes: int,
    *,
    env: dict[str, str] | None = None,
    single_thread: bool = True,
) -> Iterator[tuple[str, float]]:
    """(base URL, seconds from launch to ready) of a CPU server (one thread unless `single_thread`
    is False: then the server's own choice, or what `env` sets), stopped on exit."""
    port = free_port()
    base = {
        key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "KVASIR_THREADS")
    }
    env = {
        **base,
        "PYTHONSAFEPATH": "1",
        **({"OMP_NUM_THREADS": "1"} if single_thread else {}),
        **(env or {}),
    }
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--model", model, "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
        "--max-model-len", str(max_model_len), "--kv-cache-bytes", str(kv_cache_bytes),
    ]  # fmt: skip
    started = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"kvasir serve did not become ready: {' '.join(command)}")
            try:
                with urllib.request.urlopen(f"{url}/ready") as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield url, time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=60)


async def stream_completion(session: Any, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """perf_counter stamps: the request's send, then each streamed chunk's arrival (one per step)."""
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    stamps = [time.perf_counter()]
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return stamps
