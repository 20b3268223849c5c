"""A prompt of megabytes must not stall the server or bloat it: a real `kvasir serve` process refuses
a 30 MB prompt (as text and as a chat message, and at /tokenize) with a 400 naming the prompt, while
/health keeps answering within a second, and its memory comes back near where it was."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.harness import MODEL, TIMEOUT, serve_process

pytestmark = pytest.mark.slow
HUGE = "a " * (15 << 20)  # 30 MB of text, under the 32 MiB body cap
RSS_BOUND_MB = 300  # after the huge requests, RSS stays within this of the baseline


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[tuple[str, int]]:
    with serve_process(tiny_checkpoint("llama")) as running:
        yield running.url, running.process.pid


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": HUGE}], "max_tokens": 1},
        ),
        ("/tokenize", {"model": MODEL, "prompt": HUGE}),
    ],
)
def test_a_huge_prompt_is_refused_without_stalling(
    server: tuple[str, int], path: str, body: dict[str, object]
) -> None:
    url, pid = server
    httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "warm", "max_tokens": 2}, timeout=TIMEOUT
    )
    baseline = _rss_mb(pid)
    answer: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answer.append(httpx.post(url + path, json=body, timeout=TIMEOUT))
    )
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        began = time.monotonic()
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        slowest = max(slowest, time.monotonic() - began)
        time.sleep(0.05)
    sender.join()
    response = answer[0]
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert (
        error["param"] == ("messages" if "messages" in body else "prompt")
        and "context length" in error["message"]
    )
    assert slowest < 1.0, f"/health took {slowest:.2f}s while the prompt was refused"
    time.sleep(0.5)
    assert _rss_mb(pid) < baseline + RSS_BOUND_MB, (baseline, _rss_mb(pid))
    ok = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "still here", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert ok.status_code == 200
