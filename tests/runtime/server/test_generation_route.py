"""The path both generation routes share (`server/generation_route.py`): the same refusals in the
same order, admission counted over every prompt and choice before any tokenizing or rendering,
and each route's errors naming the fields its client sent."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def small(tiny_checkpoint: Callable[..., Path]) -> Iterator[RunningServer]:
    """At most 4 sequences at once: 2 running, 2 waiting."""
    config = tiny_engine_config(tiny_checkpoint("llama"), max_num_seqs=2)
    with serve(build_app(config, ServerConfig(max_queue_len=2))) as running:
        yield running


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=TIMEOUT)


@contextmanager
def tokenizer_calls(server: RunningServer) -> Iterator[list[str]]:
    """Every encode and chat render the server's tokenizer does inside the block."""
    tokenizer = server.state.tokenizer
    calls: list[str] = []
    encode, render = tokenizer.encode, tokenizer.apply_chat_template

    def counted_encode(*args: Any, **kwargs: Any) -> Any:
        calls.append("encode")
        return encode(*args, **kwargs)

    def counted_render(*args: Any, **kwargs: Any) -> Any:
        calls.append("render")
        return render(*args, **kwargs)

    tokenizer.encode, tokenizer.apply_chat_template = counted_encode, counted_render  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        tokenizer.encode, tokenizer.apply_chat_template = encode, render  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, {"messages": HI, "n": 5}),  # one conversation, 5 choices
        (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 2}),  # 3 prompts x 2 choices: n alone would fit
    ],
    ids=["chat", "completions"],
)
def test_sequences_past_capacity_are_refused_on_n_before_any_tokenizing(
    small: RunningServer, path: str, body: dict[str, Any]
) -> None:
    with tokenizer_calls(small) as calls:
        response = post(small, path, {**body, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("n", "too_many_sequences")
    assert "holds at most 4" in error["message"]
    assert calls == [], calls


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "hi"})])
def test_an_unknown_model_is_named_before_the_sequences_are_counted(
    small: RunningServer, path: str, body: dict[str, Any]
) -> None:
    response = post(small, path, {**body, "model": "other", "n": 50, "max_tokens": 1})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["param"] == "model"


def test_a_malformed_prompt_is_refused_before_the_sequences_are_counted(small: RunningServer) -> None:
    response = post(small, COMPLETIONS, {"prompt": [], "n": 50, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_a_conversation_rendered_past_the_context_is_refused_on_messages(small: RunningServer) -> None:
    """Its characters pass the cheap check; the rendered prompt is the one too long for 256 tokens."""
    words = " ".join(f"w{i}" for i in range(300))
    chat = post(small, CHAT, {"messages": [{"role": "user", "content": words}], "max_tokens": 1})
    completion = post(small, COMPLETIONS, {"prompt": words, "max_tokens": 1})
    assert chat.status_code == completion.status_code == 400, (chat.text, completion.text)
    chat_error, completion_error = chat.json()["error"], completion.json()["error"]
    assert (chat_error["param"], completion_error["param"]) == ("messages", "prompt")
    assert "context length" in chat_error["message"], chat_error


@pytest.mark.parametrize("length_field", ["max_tokens", "max_completion_tokens"])
def test_a_held_chat_answer_names_the_length_field_the_client_sent(
    tiny_checkpoint: Callable[..., Path], length_field: str
) -> None:
    # 64 choices x 200 tokens x (1 + 20) logprobs is past the bound on a non-streamed answer.
    body = {"messages": HI, "n": 64, length_field: 200, "logprobs": True, "top_logprobs": 20}
    with serve(build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig())) as roomy:
        response = post(roomy, CHAT, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "top_logprobs", error
    assert f"Lower top_logprobs, n or {length_field}," in error["message"], error
