"""The official `openai` SDK against a real uvicorn: every answer is checked against the offline engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config

API_KEY = "sk-test-key"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    app = build_app(tiny_engine_config(checkpoint), ServerConfig(api_key=API_KEY))
    with serve(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def offline(checkpoint: Path) -> LLMEngine:
    return LLMEngine(tiny_engine_config(checkpoint))


def greedy(offline: LLMEngine, prompt: str | list[int], max_tokens: int, **params: Any) -> str:
    settings = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return offline.generate([prompt], settings)[0].choices[0].text


def chat_prompt(offline: LLMEngine) -> list[int]:
    text = offline.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    return offline.tokenizer.encode(text, add_special_tokens=False)


def test_completion_matches_the_offline_engine(client: openai.OpenAI, offline: LLMEngine) -> None:
    result = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "text_completion" and result.model == MODEL and result.id.startswith("cmpl-")
    [choice] = result.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.text == greedy(offline, "hello world", 6, ignore_eos=True)
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(offline.tokenizer.encode("hello world"))
    assert result.usage.completion_tokens == 6
    assert result.usage.total_tokens == result.usage.prompt_tokens + 6


def test_list_of_prompts_and_token_ids_index_choices_per_prompt(
    client: openai.OpenAI, offline: LLMEngine
) -> None:
    prompts = ["first prompt", "the second one"]
    result = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in sorted(result.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in result.choices}
    assert by_index[0] == by_index[1] == greedy(offline, prompts[0], 4)
    assert by_index[2] == by_index[3] == greedy(offline, prompts[1], 4)

    token_ids = [17, 42, 99, 7]
    by_ids = client.completions.create(model=MODEL, prompt=token_ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == greedy(offline, token_ids, 4)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 4


def test_chat_renders_the_template_and_honours_max_completion_tokens(
    client: openai.OpenAI, offline: LLMEngine
) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    [choice] = result.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == greedy(offline, chat_prompt(offline), 5, ignore_eos=True)
    assert choice.finish_reason == "length"
    assert result.usage is not None and result.usage.prompt_tokens == len(chat_prompt(offline))
    legacy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0)
    assert legacy.usage is not None and legacy.usage.completion_tokens <= 3


def test_chat_stream_with_usage_equals_the_whole_answer(client: openai.OpenAI, offline: LLMEngine) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 7
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert content == greedy(offline, chat_prompt(offline), 7, ignore_eos=True)
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_completion_stream_with_n_choices(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="count with me",
        max_tokens=5,
        n=3,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 15
    assert len(set(texts.values())) > 1  # three samples, each with its own seed stream


def test_logprobs_in_both_shapes(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    assert logprobs.top_logprobs is not None
    for sampled, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2
        assert sampled == pytest.approx(max(top.values()), abs=1e-4)  # greedy took the most likely

    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and 1 <= len(content) <= 3
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())


def test_stop_string_ends_the_choice_before_it(client: openai.OpenAI, offline: LLMEngine) -> None:
    full = greedy(offline, "stop test", 12, ignore_eos=True)
    stop = full[4:6]
    expected = full[: full.index(stop)]
    result = client.completions.create(
        model=MODEL,
        prompt="stop test",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        result = client.completions.create(
            model=MODEL,
            prompt="random",
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        return result.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_invalid_fields_are_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad_temperature:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert bad_temperature.value.status_code == 400
    assert bad_temperature.value.body["param"] == "temperature"  # type: ignore[index]
    assert bad_temperature.value.body["type"] == "invalid_request_error"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as bad_type:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"top_k": "many"})
    assert bad_type.value.body["param"] == "top_k"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model=MODEL, prompt="x", extra_body={"temprature": 0.5})
    assert unknown.value.body["param"] == "temprature"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hello world", max_tokens=300)
    message = too_long.value.body["message"]  # type: ignore[index]
    assert "maximum context length is 256" in message and "requested 308 tokens" in message
    assert too_long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as chat_too_long:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 300}], max_tokens=1
        )
    assert chat_too_long.value.body["param"] == "messages"  # type: ignore[index]


def test_unknown_model_is_404_and_bad_key_is_401(client: openai.OpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="x")
    assert not_found.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert [m.id for m in client.models.list()] == [MODEL]

    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for probe in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(server.url + probe, timeout=TIMEOUT).status_code == 200, probe
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, timeout=TIMEOUT).status_code == 401


def test_tokenize_and_detokenize_round_trip(server: RunningServer, offline: LLMEngine) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(
        server.url + "/tokenize", json={"prompt": "hello world"}, headers=headers, timeout=TIMEOUT
    ).json()
    assert tokens["tokens"] == offline.tokenizer.encode("hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, headers=headers, timeout=TIMEOUT)
    assert chat.json()["tokens"] == chat_prompt(offline)
    text = httpx.post(
        server.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers, timeout=TIMEOUT
    ).json()
    assert text["prompt"] == "hello world"
