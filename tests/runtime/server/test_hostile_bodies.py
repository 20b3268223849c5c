"""Bodies that are cheap to send and were expensive to parse or render, sent with the API key to a
real `kvasir serve` process: each is answered (400 naming the field, or 200) while /health keeps
answering within a second and the server's RSS grows by less than 500 MB; and JSON nested at any
depth, in any field, is a 400, never a 500."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvasir.runtime.server.json_shape import MAX_VALUES
from tests.runtime.server.harness import TIMEOUT, ServerProcess, serve_process, watch

pytestmark = pytest.mark.slow
KEY = "hostile-test-key"
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
RSS_BOUND_MB = 500
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[ServerProcess]:
    with serve_process(tiny_checkpoint("llama"), "--api-key", KEY) as running:
        yield running


def _messages(count: int) -> bytes:
    return b'"messages":[' + b",".join([b'{"role":"user"}'] * count) + b"]"


def _members(count: int) -> bytes:
    return b",".join(b'"k%d":0' % i for i in range(count))


# (id, path, body, expected status, expected param): each under the 32 MiB body cap, built when used.
BODIES = [
    ("2M-messages-chat", "/v1/chat/completions", lambda: b"{" + _messages(2_000_000) + b',"max_tokens":1}', 400, "messages"),
    ("2M-messages-tokenize", "/tokenize", lambda: b"{" + _messages(2_000_000) + b"}", 400, "messages"),
    # Within the shape bounds: refused on the chat template's per-message tokens, before rendering.
    ("16k-messages-chat", "/v1/chat/completions", lambda: b"{" + _messages(16_000) + b',"max_tokens":1}', 400, "messages"),
    ("16k-messages-tokenize", "/tokenize", lambda: b"{" + _messages(16_000) + b"}", 400, "messages"),
    ("500k-unknown-fields", "/v1/completions", lambda: b'{"prompt":"x",' + _members(500_000) + b"}", 400, None),
    ("1M-key-metadata", "/v1/completions", lambda: b'{"prompt":"x","metadata":{' + _members(1_000_000) + b"}}", 400, "metadata"),
    ("5M-empty-prompts", "/v1/completions", lambda: b'{"prompt":[' + b",".join([b"[]"] * 5_000_000) + b"]}", 400, "prompt"),
    ("3M-stop-strings", "/v1/completions", lambda: b'{"prompt":"x","stop":[' + b",".join([b'"ab"'] * 3_000_000) + b"]}", 400, "stop"),
    ("1M-deep-metadata", "/v1/completions", lambda: b'{"prompt":"x","metadata":' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}", 400, "metadata"),
    ("escape-heavy-prompt", "/v1/completions", lambda: b'{"prompt":"' + b'\\"' * 15_000_000 + b'"}', 400, "prompt"),
    ("1M-token-ids-prompt", "/v1/completions", lambda: b'{"prompt":[' + b",".join([b"5"] * (MAX_VALUES - 10)) + b"]}", 400, "prompt"),
    ("1M-token-ids-detokenize", "/detokenize", lambda: b'{"tokens":[' + b",".join([b"5"] * (MAX_VALUES - 10)) + b"]}", 200, None),
]  # fmt: skip


@pytest.mark.parametrize("path, build, status, param", [b[1:] for b in BODIES], ids=[b[0] for b in BODIES])
def test_a_hostile_body_neither_stalls_nor_bloats_the_server(
    server: ServerProcess, path: str, build: Callable[[], bytes], status: int, param: str | None
) -> None:
    body = build()
    assert len(body) < 32 << 20
    watched = watch(
        server.url,
        server.process.pid,
        lambda: httpx.post(server.url + path, content=body, headers=HEADERS, timeout=TIMEOUT),
    )
    response = watched.response
    assert response.status_code == status, response.text[:300]
    if status == 400:
        assert response.json()["error"]["param"] == param, response.text[:300]
    assert watched.slowest_health_s < HEALTH_BOUND_S, f"/health took {watched.slowest_health_s:.2f}s"
    assert watched.rss_growth_mb < RSS_BOUND_MB, f"RSS grew by {watched.rss_growth_mb:.0f} MB"


NESTED = [
    ("/v1/completions", b'{"prompt":"hi","max_tokens":1,"metadata":%s}', "metadata"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":%s}],"max_tokens":1}', "messages"),
    ("/tokenize", b'{"messages":[{"role":"user","content":"x","name":%s}]}', "messages"),
]


@pytest.mark.parametrize("depth", [64, 65, 956, 990, 1000, 5000])
@pytest.mark.parametrize("path, template, field", NESTED, ids=["metadata", "content", "name"])
def test_deep_nesting_is_a_400_naming_the_field(
    server: ServerProcess, depth: int, path: str, template: bytes, field: str
) -> None:
    for opening, closing in ((b"[", b"]"), (b'{"a":', b"}")):
        body = template % (opening * depth + b'"x"' + closing * depth)
        response = httpx.post(server.url + path, content=body, headers=HEADERS, timeout=TIMEOUT)
        assert response.status_code == 400, (depth, response.text[:300])
        assert response.json()["error"]["param"] == field, response.text[:300]
