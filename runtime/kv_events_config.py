"""`--kv-events-config`: publish KV-cache events (blocks stored and removed) in vLLM's wire format,
so llm-d's precise prefix-cache scorer can track which blocks each Kvasir pod holds.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "topic": "kv@$(POD_IP)@my-model", "hash_seed": ""}

The keys are vLLM's, but for `hash_seed` (vLLM takes it from PYTHONHASHSEED) and `bind`, which are
Kvasir's. Without `endpoint` the publisher binds tcp://127.0.0.1:5557, loopback only: every
prompt's token ids go out on this socket, unauthenticated, so reaching other hosts is asked for
explicitly (`tcp://*:5557`, or an indexer's address). Torch-free."""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("zmq", "null")
# ZeroMQ transports a publisher can use across processes (inproc:// is one process's own).
SCHEMES = ("tcp", "ipc")
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
# Hosts that mean every interface: an endpoint with one binds, as vLLM's does ("*" or "::").
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
# ZeroMQ's high-water mark is a C int.
MAX_HWM = (1 << 31) - 1
# An endpoint is an address, not a document.
MAX_ENDPOINT_CHARS = 1024

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 200


def _shown(value: Any) -> str:
    """A value in an error message, cut short (a bad value may be a megabyte of nested lists)."""
    return _REPR.repr(value)


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    # "" (not given): DEFAULT_ENDPOINT, bound. A wildcard host (`tcp://*:5557`) binds every
    # interface (subscribers connect here); any other address connects to a subscriber that binds,
    # as llm-d's indexer does, unless `bind` says otherwise.
    endpoint: str = ""
    # Kvasir's: bind (true) or connect (false) whatever the address; None: as described above.
    bind: bool | None = None
    topic: str = ""
    # The root of the block-hash chain (vLLM's NONE_HASH from PYTHONHASHSEED); the subscriber's
    # hashSeed must be the same.
    hash_seed: str = ""
    hwm: int = 100_000  # messages a slow subscriber may fall behind before ZeroMQ drops them

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {_shown(self.publisher)}"
            )
        if self.bind is not None and not isinstance(self.bind, bool):
            raise ValueError(f"kv_events_config.bind must be true or false, got {_shown(self.bind)}")
        if self.endpoint == "":
            object.__setattr__(self, "endpoint", DEFAULT_ENDPOINT)
            if self.bind is None:
                object.__setattr__(self, "bind", True)
        _check_endpoint(self.endpoint)
        for name in ("topic", "hash_seed"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")
        if isinstance(self.hwm, bool) or not isinstance(self.hwm, int) or not 0 <= self.hwm <= MAX_HWM:
            raise ValueError(
                f"kv_events_config.hwm must be an integer from 0 to {MAX_HWM}, got {_shown(self.hwm)}"
            )
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @property
    def binds(self) -> bool:
        """Whether the publisher binds `endpoint` (else it connects to it)."""
        if self.bind is not None:
            return self.bind
        return host_of(self.endpoint).startswith(WILDCARD_HOSTS)


def host_of(endpoint: str) -> str:
    """The address part of `scheme://address` (`*:5557`, `10.0.0.1:5557`, `/tmp/kv.sock`)."""
    return endpoint.split("://", 1)[1]


def _check_endpoint(endpoint: Any) -> None:
    example = "tcp://127.0.0.1:5557, tcp://*:5557 or ipc:///tmp/kv-events"
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise ValueError(
            f"kv_events_config.endpoint must be a ZeroMQ address like {example}, got {_shown(endpoint)}"
        )
    if len(endpoint) > MAX_ENDPOINT_CHARS:
        raise ValueError(f"kv_events_config.endpoint is longer than {MAX_ENDPOINT_CHARS} characters")
    scheme, address = endpoint.split("://", 1)
    if scheme not in SCHEMES:
        raise ValueError(
            f"kv_events_config.endpoint: unknown scheme {scheme + '://'!r}; one of "
            f"{', '.join(s + '://' for s in SCHEMES)} (e.g. {example})"
        )
    if not address or any(ord(char) < 33 for char in address):
        raise ValueError(f"kv_events_config.endpoint: {_shown(endpoint)} has no address, or blanks in it")
    if scheme == "tcp":
        port = address.rsplit(":", 1)[1] if ":" in address else ""
        if port != "*" and not (port.isdigit() and 0 < int(port) <= 65535):
            raise ValueError(
                f"kv_events_config.endpoint: {_shown(endpoint)} needs a port from 1 to 65535 (tcp://HOST:PORT)"
            )


def parse_kv_events_config(text: str | dict[str, Any]) -> KVEventsConfig:
    """The config from its JSON text (or a dict); ValueError naming the bad key."""
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        except RecursionError:
            raise ValueError("kv_events_config is nested too deeply to be read") from None
    else:
        data = text
    if not isinstance(data, dict):
        raise ValueError("kv_events_config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"kv_events_config: unknown key {_shown(unknown[0])}; known: {', '.join(sorted(known))}"
        )
    return KVEventsConfig(**data)
