"""LoRA adapters from the Hugging Face hub (`hf://org/name`), with no network: the hub's
`snapshot_download` is replaced at its boundary by a fake that copies tiny PEFT adapters (written
by `peft`) into the cache directory it is given, and records what it was asked for. Checked: the
repository, revision, allow_patterns, cache directory and token of each download, the thread it
runs on, the adapter then served like a local one (the same tokens), and the answers to a missing
repository (404), an unreachable hub or offline mode (503), malformed sources (400), and files
that cannot be served (400, the untrusted-file checks still apply)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub
import openai
import pytest
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

from kvasir.runtime.lora.hub import ADAPTER_FILES
from kvasir.runtime.lora.modules import LoRAModule
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.lora_adapters import make_peft_adapter
from tests.runtime.server.harness import MODEL, TIMEOUT, RunningServer, serve, tiny_engine_config

KEY = "sk-lora-hub"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKEN = "hf_test_token"


@dataclass
class FakeHub:
    """`huggingface_hub.snapshot_download` over local folders: `repos` maps `org/name` to an adapter
    directory; `reachable` False answers as the real function does when the hub cannot be reached
    and nothing is cached."""

    repos: dict[str, Path]
    calls: list[dict[str, Any]] = field(default_factory=list)
    reachable: bool = True

    def __call__(self, repo_id: str, **kwargs: Any) -> str:
        self.calls.append({"repo_id": repo_id, "thread": threading.current_thread().name, **kwargs})
        if not self.reachable or kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("cannot find the requested files in the local cache")
        if repo_id not in self.repos:
            url = f"https://huggingface.co/api/models/{repo_id}"
            response = httpx.Response(404, request=httpx.Request("GET", url))
            raise RepositoryNotFoundError(f"404 Client Error: {url}", response=response)  # type: ignore[arg-type]
        folder = Path(kwargs["cache_dir"], repo_id.replace("/", "--"), kwargs.get("revision") or "main")
        folder.mkdir(parents=True, exist_ok=True)
        for name in kwargs["allow_patterns"]:
            if (self.repos[repo_id] / name).exists():
                shutil.copy(self.repos[repo_id] / name, folder / name)
        return str(folder)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def dirs(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The adapter root (a copy of the hub's a2 inside, for comparison), the download directory,
    and the fake hub's repositories: two adapters and one with its weights missing."""
    top = tmp_path_factory.mktemp("lora-hub")
    hub, root, downloads = top / "hub", top / "root", top / "downloads"
    root.mkdir()
    downloads.mkdir()
    make_peft_adapter(checkpoint, hub / "a1", rank=4, seed=1, magnitude=2.0)
    make_peft_adapter(checkpoint, hub / "a2", rank=8, seed=2, magnitude=2.0)
    (hub / "a2" / "README.md").write_text("not an adapter file")
    shutil.copytree(hub / "a2", root / "a2")
    (hub / "broken").mkdir()
    shutil.copy(hub / "a1" / "adapter_config.json", hub / "broken")
    make_peft_adapter(checkpoint, top / "outside", rank=4, seed=9)
    return {"hub": hub, "root": root, "downloads": downloads}


@pytest.fixture(scope="module")
def fake_hub(dirs: dict[str, Path]) -> Iterator[FakeHub]:
    fake = FakeHub({f"org/{name}": dirs["hub"] / name for name in ("a1", "a2", "broken")})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub, "snapshot_download", fake)
        yield fake


@pytest.fixture(scope="module")
def server(checkpoint: Path, dirs: dict[str, Path], fake_hub: FakeHub) -> Iterator[RunningServer]:
    engine = tiny_engine_config(
        checkpoint,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        download_dir=str(dirs["downloads"]),
        hf_token=TOKEN,
    )
    config = ServerConfig(
        api_key=KEY,
        lora_modules=(LoRAModule("start", "hf://org/a1", revision="v1"),),
        lora_root=str(dirs["root"]),
    )
    with serve(build_app(engine, config)) as running:
        yield running


@pytest.fixture
def hub(fake_hub: FakeHub) -> Iterator[FakeHub]:
    """The module's fake hub, reachable and with no calls recorded, for one test."""
    fake_hub.calls.clear()
    fake_hub.reachable = True
    yield fake_hub
    fake_hub.reachable = True


def post(server: RunningServer, body: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=TIMEOUT)


def unload(server: RunningServer, name: str) -> None:
    answer = httpx.post(
        server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH, timeout=TIMEOUT
    )
    assert answer.status_code == 200, answer.text


def roots(server: RunningServer) -> dict[str, str]:
    cards = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=TIMEOUT).json()["data"]
    return {card["id"]: card["root"] for card in cards if card.get("parent")}


def greedy(server: RunningServer, model: str) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)
    answer = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=8, temperature=0.0
    )
    return answer.choices[0].text


def assert_clean(answer: httpx.Response, dirs: dict[str, Path]) -> None:
    """An OpenAI error object naming no server directory and holding no traceback."""
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in answer.text
    assert all(str(path) not in answer.text for path in dirs.values())


def test_a_start_up_hub_adapter_is_downloaded_with_the_models_cache_and_token(
    server: RunningServer, dirs: dict[str, Path], fake_hub: FakeHub
) -> None:
    start = [call for call in fake_hub.calls if call["repo_id"] == "org/a1"]
    assert start and start[0]["revision"] == "v1"
    assert start[0]["allow_patterns"] == list(ADAPTER_FILES)
    assert start[0]["cache_dir"] == str(dirs["downloads"]) and start[0]["token"] == TOKEN
    assert start[0]["local_files_only"] is False
    assert start[0]["thread"].startswith("kvasir-lora-load")  # never the event loop or the engine's
    assert roots(server)["start"] == "org/a1@v1"
    assert greedy(server, "start") != greedy(server, MODEL)


def test_a_hub_load_serves_exactly_as_the_same_files_loaded_locally(
    server: RunningServer, hub: FakeHub, dirs: dict[str, Path]
) -> None:
    answer = post(server, {"lora_name": "hub-a2", "lora_path": "hf://org/a2"})
    assert answer.status_code == 200, answer.text
    assert answer.text == "Success: LoRA adapter 'hub-a2' added successfully."
    (call,) = hub.calls
    assert (call["repo_id"], call["revision"], call["token"]) == ("org/a2", None, TOKEN)
    assert call["allow_patterns"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert call["cache_dir"] == str(dirs["downloads"]) and call["thread"].startswith("kvasir-lora-load")
    assert not list(dirs["downloads"].rglob("README.md"))  # only the adapter's two files
    assert post(server, {"lora_name": "local-a2", "lora_path": "a2"}).status_code == 200
    assert roots(server)["hub-a2"] == "org/a2" and roots(server)["local-a2"] == "a2"
    assert greedy(server, "hub-a2") == greedy(server, "local-a2") != greedy(server, MODEL)
    # A revision reloads in place; /v1/models then names it.
    pinned = {"lora_name": "hub-a2", "lora_path": "hf://org/a2", "revision": "abc123", "load_inplace": True}
    assert post(server, pinned).status_code == 200
    assert hub.calls[-1]["revision"] == "abc123" and roots(server)["hub-a2"] == "org/a2@abc123"
    unload(server, "hub-a2")
    unload(server, "local-a2")


def test_a_repository_the_hub_does_not_have_is_404(
    server: RunningServer, hub: FakeHub, dirs: dict[str, Path]
) -> None:
    answer = post(server, {"lora_name": "x", "lora_path": "hf://org/nope"})
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "not_found"
    assert "not found on the Hugging Face hub" in answer.json()["error"]["message"]
    assert_clean(answer, dirs)
    assert "x" not in roots(server)


def test_an_unreachable_hub_is_503(server: RunningServer, hub: FakeHub, dirs: dict[str, Path]) -> None:
    hub.reachable = False
    answer = post(server, {"lora_name": "x", "lora_path": "hf://org/a2"})
    assert answer.status_code == 503, answer.text
    assert "the Hugging Face hub cannot be reached" in answer.json()["error"]["message"]
    assert_clean(answer, dirs)


def test_offline_mode_is_a_clear_503(
    server: RunningServer, hub: FakeHub, dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    answer = post(server, {"lora_name": "x", "lora_path": "hf://org/a2"})
    assert answer.status_code == 503, answer.text
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in answer.json()["error"]["message"]
    assert hub.calls[-1]["local_files_only"] is True  # the cache only, never the network
    assert_clean(answer, dirs)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"lora_path": "hf://org"}, 400, "must look like hf://org/name"),
        ({"lora_path": "hf://org/a2/extra"}, 400, "must look like hf://org/name"),
        ({"lora_path": "hf://org/a2@v1"}, 400, "own field (revision)"),
        ({"lora_path": "hf://org/a2", "revision": "a b"}, 400, "blank"),
        ({"lora_path": "a2", "revision": "v1"}, 400, "revision applies only"),
        ({"lora_path": "hf://org/broken"}, 400, "cannot be served"),  # the file checks still apply
        ({"lora_path": "../outside"}, 400, "outside the adapter root"),  # local paths: as before
    ],
)
def test_bad_hub_sources_are_clear_400s(
    server: RunningServer,
    hub: FakeHub,
    dirs: dict[str, Path],
    body: dict[str, str],
    status: int,
    message: str,
) -> None:
    answer = post(server, {"lora_name": "x", **body})
    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]["message"]
    assert_clean(answer, dirs)
    assert "x" not in roots(server)
