"""`--kv-events-config`: publish KV-cache events (blocks stored and removed) in vLLM's wire format,
so llm-d's precise prefix-cache scorer can track which blocks each Kvasir pod holds.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "topic": "kv@$(POD_IP)@my-model", "hash_seed": ""}

The keys are vLLM's (`hash_seed` is Kvasir's: vLLM takes it from PYTHONHASHSEED). Torch-free."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = True
    publisher: str = "zmq"
    # A `*` or `::` host binds (subscribers connect here); any other address connects to a
    # subscriber that binds, as llm-d's indexer does.
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    # The root of the block-hash chain (vLLM's NONE_HASH from PYTHONHASHSEED); the subscriber's
    # hashSeed must be the same.
    hash_seed: str = ""
    hwm: int = 100_000  # messages a slow subscriber may fall behind before ZeroMQ drops them

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}"
            )
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(
                f"kv_events_config.endpoint must be a ZeroMQ address like tcp://*:5557, got {self.endpoint!r}"
            )
        for name in ("topic", "hash_seed"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string")
        if isinstance(self.hwm, bool) or not isinstance(self.hwm, int) or self.hwm < 0:
            raise ValueError(f"kv_events_config.hwm must be a non-negative integer, got {self.hwm!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(text: str | dict[str, Any]) -> KVEventsConfig:
    """The config from its JSON text (or a dict); ValueError naming the bad key."""
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
    else:
        data = text
    if not isinstance(data, dict):
        raise ValueError("kv_events_config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"kv_events_config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return KVEventsConfig(**data)
