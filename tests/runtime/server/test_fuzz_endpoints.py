"""Hypothesis-generated JSON bodies against every POST endpoint of a real server: whatever the
fields, values, strings (lone surrogates included) and template keys, the answer is never a 5xx and
the server stays healthy; and bodies that are cheap to send but were expensive to parse, validate or
render (a small value repeated millions of times, or nested past `json.loads`' own limit, in any
field) are answered in bounded time while /health keeps answering."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config, watch

# Every code point, surrogates included: JSON's \uXXXX escapes can carry them.
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=False, width=32) | ANY_TEXT
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=6,
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]), "content": VALUES}
    ),
    max_size=3,
)
FIELDS = {
    "model": st.sampled_from([MODEL, "other"]) | ANY_TEXT,
    "prompt": ANY_TEXT | st.lists(st.integers(-5, 600), max_size=6) | VALUES,
    "messages": MESSAGES | VALUES,
    "max_tokens": st.integers(-2, 3),
    "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3, allow_nan=False),
    "top_p": st.floats(-1, 2, allow_nan=False),
    "stop": ANY_TEXT | st.lists(ANY_TEXT, max_size=4),
    "logprobs": VALUES,
    "stream": st.booleans(),
    "chat_template_kwargs": st.dictionaries(
        ANY_TEXT | st.sampled_from(["messages", "self", "template"]), VALUES, max_size=3
    ),
    "tokens": st.lists(st.integers(-3, 600), max_size=5) | VALUES,
    "add_special_tokens": VALUES,
    "seed": VALUES,
}
BODIES = st.fixed_dictionaries({}, optional=FIELDS) | VALUES
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Callable[..., Path]) -> Iterator[RunningServer]:
    with serve(build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig())) as running:
        yield running


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=PATHS, body=BODIES)
def test_no_body_gets_a_5xx(server: RunningServer, path: str, body: Any) -> None:
    content = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as \ud800 escapes
    response = httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT
    )
    assert response.status_code < 500, (
        f"{path} {content[:300]!r} -> {response.status_code} {response.text[:300]}"
    )
    if response.status_code >= 400:
        assert "error" in response.json()


# A unit repeated `count` times inside `depth` arrays, placed in one field of one route.
UNITS = st.sampled_from(
    [b"{}", b"[]", b"0", b'"a"', b'{"role":"user"}', b'{"type":"text","text":"a"}', b'"\\ud800"']
)
PLACES = st.sampled_from(
    [
        ("/v1/chat/completions", b'{"messages":%s,"max_tokens":1}'),
        ("/v1/chat/completions", b'{"messages":[{"role":"user","content":%s}],"max_tokens":1}'),
        (
            "/v1/chat/completions",
            b'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"k":%s}}',
        ),
        ("/tokenize", b'{"messages":%s}'),
        ("/v1/completions", b'{"prompt":%s,"max_tokens":1}'),
        ("/v1/completions", b'{"prompt":"x","max_tokens":1,"stop":%s}'),
        ("/v1/completions", b'{"prompt":"x","max_tokens":1,"metadata":{"k":%s}}'),
        ("/detokenize", b'{"tokens":%s}'),
        ("/v1/completions", b"%s"),
    ]
)
COUNTS = st.sampled_from([0, 1, 2, 1000, 16_383, 16_385, 300_000, 1_100_000, 3_000_000])
DEPTHS = st.sampled_from([0, 1, 62, 63, 64, 65, 956, 990, 1100])
HEALTH_BOUND_S = 2.0  # in-process the test's own threads share the interpreter: a wider margin


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(place=PLACES, unit=UNITS, count=COUNTS, depth=DEPTHS)
def test_cheap_to_send_expensive_to_parse_bodies_are_answered_in_bounded_time(
    server: RunningServer, place: tuple[str, bytes], unit: bytes, count: int, depth: int
) -> None:
    path, template = place
    body = template % (b"[" * (depth + 1) + b",".join([unit] * count) + b"]" * (depth + 1))
    if len(body) > ServerConfig().max_request_bytes:
        return  # a 413, tested elsewhere
    headers = {"content-type": "application/json"}
    watched = watch(
        server.url,
        None,
        lambda: httpx.post(server.url + path, content=body, headers=headers, timeout=TIMEOUT),
    )
    response, slowest = watched.response, watched.slowest_health_s
    assert response.status_code < 500, (
        f"{path} {body[:200]!r} -> {response.status_code} {response.text[:300]}"
    )
    if response.status_code >= 400:
        assert "error" in response.json()
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f}s during {path} {body[:100]!r}"


def test_healthy_after_the_fuzz(server: RunningServer) -> None:
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    ok = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert ok.status_code == 200
