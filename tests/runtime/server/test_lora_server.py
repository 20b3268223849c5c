"""Multi-LoRA serving over HTTP on a real uvicorn: adapters as `model` through the `openai` SDK,
/v1/models with `parent`, vLLM's load/unload endpoints behind the API key with the allow-listed
root (traversal and symlinks refused), the 404 after an unload, the 409 past the unload bound,
the LoRA metrics, and adapters loaded and unloaded while 8 streams run, none failing."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvasir.runtime.lora.modules import LoRAModule
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.lora_adapters import make_peft_adapter
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def root(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapter root: a1..a3 inside, one adapter outside it, and a symlink inside to it."""
    top = tmp_path_factory.mktemp("lora")
    adapters = top / "adapters"
    adapters.mkdir()
    for index in (1, 2, 3):
        make_peft_adapter(checkpoint, adapters / f"a{index}", rank=4 * index, seed=index, magnitude=2.0)
    make_peft_adapter(checkpoint, top / "outside", rank=4, seed=9)
    os.symlink(top / "outside", adapters / "sneaky")
    return adapters


def lora_app(checkpoint: Path, root: Path, **server: object) -> object:
    engine = tiny_engine_config(checkpoint, enable_lora=True, max_loras=2, max_lora_rank=16)
    config = ServerConfig(
        api_key=KEY,
        lora_modules=(LoRAModule("start", str(root / "a1")),),
        lora_root=str(root),
        **server,  # type: ignore[arg-type]
    )
    return build_app(engine, config)


@pytest.fixture(scope="module")
def server(checkpoint: Path, root: Path) -> Iterator[RunningServer]:
    with serve(lora_app(checkpoint, root, lora_unload_timeout=60.0)) as running:  # type: ignore[arg-type]
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def post(
    server: RunningServer, path: str, body: object, headers: dict[str, str] | None = AUTH
) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=TIMEOUT)


def greedy(client: openai.OpenAI, model: str, **extra: object) -> str:
    answer = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=8, temperature=0.0, extra_body=extra or None
    )
    assert answer.model == model
    return answer.choices[0].text


def test_models_lists_the_adapters_with_their_parent(client: openai.OpenAI) -> None:
    models = {model.id: model for model in client.models.list().data}
    assert set(models) == {MODEL, "start"}
    card = models["start"].model_dump()
    assert (card["parent"], card["root"]) == (MODEL, "a1")  # the directory's last part only
    assert models[MODEL].model_dump().get("parent") is None
    assert client.models.retrieve("start").model_dump()["parent"] == MODEL


def test_an_adapter_is_a_model_and_changes_the_answer(client: openai.OpenAI) -> None:
    base, adapted = greedy(client, MODEL), greedy(client, "start")
    assert adapted != base
    assert greedy(client, "start") == adapted  # deterministic
    assert greedy(client, "start", cache_salt="tenant-1") == adapted  # a salt changes no output
    chat = client.chat.completions.create(
        model="start",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_body={"cache_salt": "tenant-1"},
    )
    assert chat.model == "start"
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        greedy(client, "start", cache_salt="")


def test_load_and_unload_follow_vllm(server: RunningServer, client: openai.OpenAI) -> None:
    answer = post(server, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "a2"})
    assert answer.status_code == 200, answer.text
    assert answer.text == "Success: LoRA adapter 'second' added successfully."
    assert answer.headers["content-type"].startswith("text/plain")
    assert greedy(client, "second") != greedy(client, MODEL)
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": "a2"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'second' removed successfully.")
    with pytest.raises(openai.NotFoundError) as missing:
        greedy(client, "second")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    twice = post(server, "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert twice.status_code == 404 and twice.json()["error"]["code"] == "not_found"
    # Absolute paths inside the root are fine too; a reload is a new adapter id.
    absolute = post(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "second", "lora_path": str(Path(server_root(server), "a2"))},
    )
    assert absolute.status_code == 200
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200


def server_root(server: RunningServer) -> str:
    root = server.state.config.lora_root
    assert root is not None
    return root


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"lora_name": "x", "lora_path": "../outside"}, 400, "outside the adapter root"),
        ({"lora_name": "x", "lora_path": "/etc"}, 400, "outside the adapter root"),
        ({"lora_name": "x", "lora_path": "sneaky"}, 400, "outside the adapter root"),  # a symlink out
        ({"lora_name": "x", "lora_path": "a1/../../outside"}, 400, "outside the adapter root"),
        ({"lora_name": "x", "lora_path": "nope"}, 404, "No adapter found"),
        ({"lora_name": "x", "lora_path": "a1\u0000"}, 400, "NUL"),
        ({"lora_name": MODEL, "lora_path": "a1"}, 400, "base model's served name"),
        ({"lora_name": "a b", "lora_path": "a1"}, 400, "blank"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "x", "lora_path": "a1", "extra": 1}, 400, "extra"),
    ],
)
def test_bad_loads_are_clear_400s_and_404s(
    server: RunningServer, body: dict, status: int, message: str
) -> None:
    answer = post(server, "/v1/load_lora_adapter", body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in answer.text and server_root(server) not in answer.text


def test_the_endpoints_check_the_key_before_the_body(server: RunningServer) -> None:
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for body in ({"lora_name": "x", "lora_path": "a1"}, {"junk": True}):
            assert post(server, path, body, headers=None).status_code == 401
        wrong = httpx.post(server.url + path, content=b"{not json", headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401


def test_lora_metrics(server: RunningServer, client: openai.OpenAI) -> None:
    greedy(client, "start")
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert re.search(r'kvasir_lora_requests_total\{lora_name="start",model_name="tiny"\} [1-9]', text)
    assert re.search(r"kvasir_lora_load_seconds_count\{model_name=\"tiny\"\} [1-9]", text)
    assert re.search(
        r'kvasir_lora_requests_info\{max_lora="2",model_name="tiny",running_lora_adapters="",', text
    )


def test_loading_and_unloading_during_8_streams(server: RunningServer, root: Path) -> None:
    """8 streams on the base, "start" and a run-time adapter "third": while they run, another
    adapter is loaded and "third" is unloaded (the unload waits for its streams). Every stream
    ends with [DONE] and no error; then "third" is a 404 and its metrics series are gone."""
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "third", "lora_path": "a3"}).status_code == 200
    models = [MODEL, "start", "third", "third", MODEL, "start", "third", "start"]

    async def stream(http: httpx.AsyncClient, model: str, started: asyncio.Event) -> list[str]:
        body = {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": 48,
            "ignore_eos": True,
            "stream": True,
        }
        lines = []
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as answer:
            assert answer.status_code == 200, await answer.aread()
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    started.set()
                    lines.append(line)
        return lines

    async def scenario() -> tuple[list[list[str]], list[httpx.Response], str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            events = [asyncio.Event() for _ in models]
            streams = [
                asyncio.create_task(stream(http, model, event))
                for model, event in zip(models, events, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), TIMEOUT)
            metrics = (await http.get("/metrics")).text  # while all 8 run
            load = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "fourth", "lora_path": "a2"}, headers=AUTH
            )
            unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "third"}, headers=AUTH)
            results = await asyncio.gather(*streams)
            return results, [load, unload], metrics

    results, (load, unload), metrics = asyncio.run(scenario())
    assert load.status_code == 200 and unload.status_code == 200, (load.text, unload.text)
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in lines)
        assert '"finish_reason":"length"' in lines[-2]  # all 48 tokens, none cut short
    running = re.search(r'running_lora_adapters="([^"]*)"', metrics)
    assert running is not None and set(running.group(1).split(",")) <= {"start", "third"}
    assert server.state.engine is not None and server.state.engine.loras is not None
    assert server.state.engine.loras.in_flight("third") == 0
    after = post(server, "/v1/completions", {"model": "third", "prompt": "hi", "max_tokens": 2})
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert 'lora_name="third"' not in text
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "fourth"}).status_code == 200


def test_unload_past_the_bound_is_409_and_the_adapter_serves_on(checkpoint: Path, root: Path) -> None:
    with serve(lora_app(checkpoint, root, lora_unload_timeout=0.0)) as running:  # type: ignore[arg-type]
        engine = running.state.engine
        assert engine is not None
        lease = engine.acquire_lora("start")  # a request in flight, as the server holds one
        assert lease is not None
        busy = post(running, "/v1/unload_lora_adapter", {"lora_name": "start"})
        assert busy.status_code == 409, busy.text
        assert "in flight" in busy.json()["error"]["message"]
        ok = post(running, "/v1/completions", {"model": "start", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        lease.release()
        assert post(running, "/v1/unload_lora_adapter", {"lora_name": "start"}).status_code == 200


def test_without_enable_lora_the_endpoints_say_so(checkpoint: Path) -> None:
    with serve(build_app(tiny_engine_config(checkpoint), ServerConfig())) as running:
        answer = post(running, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a1"}, headers=None)
        assert answer.status_code == 400 and "--enable-lora" in answer.json()["error"]["message"]
        info = httpx.get(running.url + "/metrics", timeout=TIMEOUT).text
        assert 'max_lora="0"' in info
