"""Which LoRA adapter a request runs with: the record the server, the engine, the scheduler and
the model runner all read (torch-free, engine-free).

An adapter is known by its served `name`; `adapter_id` is unique per load, so an adapter unloaded
and loaded again under the same name is a new id, and nothing kept for the old weights (a slot,
a cached block) is ever taken for the new ones. `digest` is a SHA-256 of the adapter's weight
and config bytes: it keys the prefix cache, so two adapters share cached blocks only when their
weights are the same bytes, whatever their names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One loaded adapter, as a request refers to it."""

    name: str  # the served model name a client sends as `model`
    adapter_id: int  # > 0, unique per load for the life of the process
    path: str  # the adapter's directory (PEFT layout), already checked against the allowed root
    digest: bytes  # SHA-256 of adapter_config.json and the weight file's bytes
    rank: int
    base_model_name: str = ""  # the served name of the base model (`parent` in /v1/models)
    hub_id: str | None = None  # `org/name[@revision]` when downloaded from the hub (`root` in /v1/models)

    @property
    def cache_key(self) -> bytes:
        """The prefix-cache extra key: domain-separated from `cache_salt`, so an adapter can never
        collide with a salt of the same bytes."""
        return b"lora:" + self.digest
