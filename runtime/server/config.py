"""The HTTP server's own settings (`kvasir serve` flags beyond the engine's), each also a KVASIR_* variable."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass

from kvasir.runtime.lora.modules import LoRAModule, check_lora_modules, parse_lora_module
from kvasir.runtime.settings import Flag, add_flag, check_settings, config_from_args, flags_of, setting

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# The model families whose tool calls the server can read (kvasir.runtime.tools.parsers); `auto`
# picks one from the chat template.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens, whom it lets in, how much it queues and how it shuts down.

    Each field is also the flag `--field-name` and the variable `KVASIR_FIELD_NAME` (see
    `kvasir.runtime.settings`)."""

    # Loopback unless asked (as llama.cpp's server): a pod's address is set explicitly (--host
    # 0.0.0.0 in the args the operator builds, and in the runtime image's CMD).
    host: str = setting(
        "127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every interface)",
    )
    port: int = setting(8000, type=int, minimum=0, maximum=65535, help="0: any free port")
    # A node above 0 of a multi-node group (--nnodes) serves no API: it runs its ranks and answers
    # only /health and /ready on --host/--port, for the kubelet's probes (vLLM's name).
    headless: bool = setting(
        False,
        type=bool,
        help="run only this node's tensor-parallel ranks (--node-rank above 0), driven by node 0; "
        "no OpenAI API, only /health and /ready",
    )
    api_key: str | None = setting(
        help="require `Authorization: Bearer KEY` on /v1/* (also KVASIR_API_KEY; unset: open)"
    )
    # Sequences that may wait beyond the --max-num-seqs that run; past that, 429 (see docs/serving.md).
    max_queue_len: int = setting(
        512,
        type=int,
        minimum=0,
        help="sequences that may wait beyond --max-num-seqs; more get 429 with Retry-After",
    )
    drain_timeout: float = setting(
        30.0,
        type=float,
        minimum=0,
        maximum=3600,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    retry_after: int = setting(1, type=int, minimum=0, help="Retry-After seconds on 429 and 503")
    # A 128k-token prompt is ~1 MB of JSON.
    max_request_bytes: int = setting(
        32 << 20,
        type=int,
        minimum=1,
        help="larger request bodies are refused with 413 before they are parsed",
    )
    # One body is capped above; this caps all of them at once, so many clients uploading near-cap
    # bodies together cannot make the server hold gigabytes (each is held until its answer ends).
    max_buffered_request_bytes: int = setting(
        256 << 20,
        type=int,
        minimum=1,
        help="request bodies held at once, all requests together; past it, 503 with Retry-After",
    )
    # A request's headers and body must arrive within this many seconds of its first byte, and an
    # idle keep-alive connection closes after `keep_alive_timeout`: slow clients hold no socket.
    request_read_timeout: float = setting(
        30.0,
        type=float,
        minimum=0.1,
        maximum=3600,
        help="seconds a request's headers and body may take to arrive; slower connections get 408 and are closed",
    )
    keep_alive_timeout: float = setting(
        5.0,
        type=float,
        minimum=0.1,
        maximum=3600,
        help="seconds an idle keep-alive connection stays open",
    )
    tool_call_parser: str = setting(
        "auto",
        choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls, read from its output under tool_choice 'auto' "
        "(default: auto, recognised from the chat template)",
    )
    # LoRA adapters (with --enable-lora): those loaded at start-up, and where runtime loads may read.
    lora_modules: tuple[LoRAModule, ...] = setting(
        (),
        type=parse_lora_module,
        multiple=True,
        help="LoRA adapters to serve from the start, each name=path or a JSON object "
        '{"name": ..., "path": ..., "base_model_name": ..., "revision": ...}; a path is a directory or '
        "hf://org/name (downloaded as the model is); clients ask for one by its name as `model`",
    )
    # The operator's ConfigMap, mounted in the pod: read at start, so a pod restarted after the
    # adapters changed loads the current set before it turns ready.
    lora_modules_file: str | None = setting(
        help="a JSON file listing more --lora-modules items (a list of objects or name=path strings), "
        "read at start-up and loaded before the server turns ready",
    )
    lora_root: str | None = setting(
        help="the directory POST /v1/load_lora_adapter may load adapters from (symbolic links and '..' "
        "resolved; nothing outside it is read), besides hf://org/name adapters it downloads; unset: "
        "adapters cannot be loaded at run time",
    )
    lora_unload_timeout: float = setting(
        30.0,
        type=float,
        minimum=0,
        maximum=3600,
        help="seconds POST /v1/unload_lora_adapter waits for the adapter's requests in flight; "
        "past it the unload is refused with 409 and the adapter serves on",
    )
    log_format: str = setting("text", choices=LOG_FORMATS)
    log_level: str = setting("info", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset to serve without a key)")
        check_lora_modules(self.lora_modules)
        if self.lora_root is not None and not os.path.isdir(self.lora_root):
            raise ValueError(f"--lora-root {self.lora_root!r} is not a directory")


SERVER_FLAGS = flags_of(ServerConfig)
_BY_NAME = {flag.name: flag for flag in SERVER_FLAGS}


def server_flag(name: str) -> Flag:
    """The definition of one server flag (KeyError for an unknown name)."""
    return _BY_NAME[name]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server (each also readable from KVASIR_<FLAG>)")
    for flag in SERVER_FLAGS:
        add_flag(group, flag)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the ServerConfig; raises ValueError naming the bad value. The adapters of
    --lora-modules-file join those of --lora-modules."""
    config = config_from_args(ServerConfig, args)
    if config.lora_modules_file is None:
        return config
    modules = config.lora_modules + read_lora_modules_file(config.lora_modules_file)
    return dataclasses.replace(config, lora_modules=modules)


def read_lora_modules_file(path: str) -> tuple[LoRAModule, ...]:
    """The --lora-modules items a JSON file lists; ValueError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as file:
            items = json.load(file)
    except OSError as exc:
        raise ValueError(f"--lora-modules-file {path!r}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError):
        raise ValueError(f"--lora-modules-file {path!r} is not valid JSON") from None
    if not isinstance(items, list):
        raise ValueError(f"--lora-modules-file {path!r} must hold a JSON list")
    modules = []
    for item in items:
        text = json.dumps(item) if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise ValueError(f"--lora-modules-file {path!r}: each item is an object or a name=path string")
        modules.append(parse_lora_module(text))
    return tuple(modules)
