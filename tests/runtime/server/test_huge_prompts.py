"""A prompt of megabytes must not stall the server or bloat it: a real `kvasir serve` process refuses
a 30 MB prompt (as text and as a chat message, and at /tokenize) with a 400 naming the prompt, while
/health keeps answering within a second, and its memory comes back near where it was."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.runtime.server.harness import MODEL, TIMEOUT, rss_mb, serve_process, watch

pytestmark = pytest.mark.slow
HUGE = "a " * (15 << 20)  # 30 MB of text, under the 32 MiB body cap
RSS_BOUND_MB = 300  # after the huge requests, RSS stays within this of the baseline


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[tuple[str, int]]:
    with serve_process(tiny_checkpoint("llama")) as running:
        yield running.url, running.process.pid


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
    baseline = rss_mb(pid)
    watched = watch(url, pid, lambda: httpx.post(url + path, json=body, timeout=TIMEOUT))
    response, slowest = watched.response, watched.slowest_health_s
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert (
        error["param"] == ("messages" if "messages" in body else "prompt")
        and "context length" in error["message"]
    )
    assert slowest < 1.0, f"/health took {slowest:.2f}s while the prompt was refused"
    time.sleep(0.5)
    assert rss_mb(pid) < baseline + RSS_BOUND_MB, (baseline, rss_mb(pid))
    ok = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "still here", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert ok.status_code == 200
