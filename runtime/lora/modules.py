"""What names and paths an adapter may have: `--lora-modules` items, adapter names, and the
allow-listed root that `POST /v1/load_lora_adapter` reads from. Torch-free and engine-free: the
flags, the server and the engine's registry all check with these.

`--lora-modules` takes vLLM's two forms: `name=path`, or a JSON object
`{"name": ..., "path": ..., "base_model_name": ..., "revision": ...}`. A path may also be a
Hugging Face repository, `hf://org/name` (`revision`, a branch, tag or commit, only with one),
downloaded as the model is (runtime/lora/hub.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096
MAX_REVISION_CHARS = 255
HF_SCHEME = "hf://"


class AdapterPathNotFoundError(ValueError):
    """The adapter directory a client named does not exist under the adapter root (a 404)."""


@dataclass(frozen=True)
class LoRAModule:
    """An adapter to load at start-up (`--lora-modules`)."""

    name: str
    path: str  # a local directory, or hf://org/name
    base_model_name: str | None = None
    revision: str | None = None  # hf:// paths only


@dataclass(frozen=True)
class HubAdapter:
    """An adapter on the Hugging Face hub: `repo_id` (`org/name`) at `revision` (None: the default
    branch)."""

    repo_id: str
    revision: str | None = None

    @property
    def public_id(self) -> str:
        """How /v1/models' `root` names it: `org/name`, or `org/name@revision` when one was asked for
        (the operator compares it with the declared adapter to see that a revision changed)."""
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def is_hub_path(path: object) -> bool:
    return isinstance(path, str) and path.startswith(HF_SCHEME)


def parse_hub_adapter(path: str, revision: object = None) -> HubAdapter:
    """`hf://org/name` (and an optional revision) as a HubAdapter; ValueError saying what is wrong."""
    repo_id = path[len(HF_SCHEME) :] if is_hub_path(path) else ""
    parts = repo_id.split("/")
    if "@" in repo_id:
        raise ValueError(f"{_short(path)}: give the revision in its own field (revision), not after '@'")
    if len(parts) != 2 or not all(parts) or any(char.isspace() or char == "\\" for char in repo_id):
        raise ValueError(f"{_short(path)} must look like hf://org/name (a repository holding one adapter)")
    if revision is not None:
        if not isinstance(revision, str) or not revision or len(revision) > MAX_REVISION_CHARS:
            raise ValueError(f"a revision is a branch, tag or commit of 1 to {MAX_REVISION_CHARS} characters")
        if any(not char.isprintable() or char.isspace() for char in revision):
            raise ValueError(f"revision {_short(revision)} has a blank or an unprintable character")
    return HubAdapter(repo_id, revision)


def check_adapter_name(name: object, base_model_name: str | None = None) -> str:
    """`name` if it can be an adapter's served name, else ValueError saying why: 1 to 256
    printable characters without blanks or commas (the metrics join names with commas), and not
    the base model's served name (an adapter may not shadow it)."""
    if not isinstance(name, str) or not name:
        raise ValueError("an adapter name must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"an adapter name has at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if any(not char.isprintable() or char.isspace() or char == "," for char in name):
        raise ValueError(f"adapter name {name!r} has a blank, a comma or an unprintable character")
    if base_model_name is not None and name == base_model_name:
        raise ValueError(f"adapter name {name!r} is the base model's served name")
    return name


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` item: `name=path` or a JSON object; ValueError naming what is wrong."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError(f"--lora-modules: {_short(text)} is not valid JSON") from None
        if not isinstance(value, dict):
            raise ValueError("--lora-modules: a JSON item must be an object")
        unknown = set(value) - {"name", "path", "base_model_name", "revision"}
        if unknown:
            raise ValueError(
                f"--lora-modules: unknown key {sorted(unknown)[0]!r} (name, path, base_model_name, revision)"
            )
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        revision = value.get("revision")
        if base is not None and not isinstance(base, str):
            raise ValueError("--lora-modules: base_model_name must be a string")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: {_short(text)} is neither name=path nor a JSON object")
        base = revision = None
    try:
        name = check_adapter_name(name)
    except ValueError as error:
        raise ValueError(f"--lora-modules: {error}") from None
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise ValueError(f"--lora-modules: adapter {name!r} needs a path")
    if is_hub_path(path):
        try:
            parse_hub_adapter(path, revision)
        except ValueError as error:
            raise ValueError(f"--lora-modules: adapter {name!r}: {error}") from None
    elif revision is not None:
        raise ValueError(f"--lora-modules: adapter {name!r}: a revision applies only to hf:// paths")
    return LoRAModule(name, path, base, revision)


def check_lora_modules(modules: tuple[LoRAModule, ...]) -> None:
    """ValueError if two modules share a name."""
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            raise ValueError(f"--lora-modules names adapter {module.name!r} twice")
        seen.add(module.name)


def resolve_adapter_path(path: object, root: str) -> str:
    """The real path of an adapter directory a client named, which must lie inside `root` (the
    allow-listed adapter root): relative paths are taken from the root, symbolic links and `..`
    are resolved first, so neither can lead out. ValueError with a message fit for the client
    (it names the path as given, never the server's directories)."""
    if not isinstance(path, str) or not path:
        raise ValueError("lora_path must be a non-empty string")
    if len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise ValueError("lora_path is too long or holds a NUL character")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, path))
    if real != real_root and os.path.commonpath([real_root, real]) != real_root:
        raise ValueError(f"lora_path {_short(path)} is outside the adapter root (--lora-root)")
    if not os.path.isdir(real):
        raise AdapterPathNotFoundError(
            f"No adapter found for lora_path {_short(path)} under the adapter root."
        )
    return real


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
