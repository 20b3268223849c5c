"""spec.lora and spec.loraAliases, declared once: the LoRA adapters an LLMDeployment serves on its
base model, and weighted aliases over them (a rollout sends 90% of `support` to v2, 10% to v1).

An adapter's source is a path on a PersistentVolumeClaim (`pvc://CLAIM/PATH`, the claim mounted
read-only under the pod's adapter root), a directory baked into the image under that root
(`/adapters/...`): the runtime loads local adapters at run time only from inside its
`--lora-root`; or a Hugging Face repository (`hf://ORG/NAME`, with an optional `revision`), which
each pod downloads itself, with the model's cache and token (docs/lora.md, "On Kubernetes")."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from kvasir.operator.api.declare import Section, spec_field
from kvasir.operator.api.kinds import Integer, Kind, Rule, Schema, String
from kvasir.operator.api.source import ModelSource, SourceKind, SpecError, parse_model_source
from kvasir.runtime.config import LORA_RANKS
from kvasir.runtime.lora.modules import HubAdapter, check_adapter_name, parse_hub_adapter

# Where adapters live in the pod: the runtime's --lora-root. Claims are mounted under CLAIMS_DIR.
LORA_ROOT = "/adapters"
CLAIMS_DIR = f"{LORA_ROOT}/claims"
MAX_ADAPTERS = 64
MAX_ALIASES = 32
MAX_ALIAS_TARGETS = 8
# A served name as the runtime accepts one (no blank, comma or control character), kept to what a
# Kubernetes user writes: at most 128 characters, so the CEL rules over the list stay cheap.
NAME_PATTERN = "^[^\\s,]+$"
MAX_NAME_CHARS = 128
SOURCE_RULE = (
    "self.matches('^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?/.+$') || self.matches('^hf://[^/@]+/[^/@]+$') || "
    f"self.startsWith('{LORA_ROOT}/')"
)
SOURCE_MESSAGE = (
    f"lora source must be pvc://CLAIM/PATH, hf://ORG/NAME or an absolute path under {LORA_ROOT}/ in the image"
)


def _served_name(name: str, path: str) -> str:
    if len(name) > MAX_NAME_CHARS:
        raise SpecError(path, f"must be at most {MAX_NAME_CHARS} characters, got {len(name)}")
    try:
        return check_adapter_name(name)
    except ValueError as exc:
        raise SpecError(path, str(exc)) from None


def _served_name_kind() -> String:
    return String(min_length=1, max_length=MAX_NAME_CHARS, pattern=NAME_PATTERN, check=_served_name)


@dataclass(frozen=True)
class AdapterSource(Kind):
    """Where an adapter's PEFT directory is: pvc://CLAIM/PATH, or /adapters/... in the image."""

    def schema(self) -> Schema:
        return {"type": "string", "maxLength": 512}

    def rules(self, name: str) -> list[Rule]:
        return [{"rule": SOURCE_RULE, "message": SOURCE_MESSAGE}]

    def parse(self, value: Any, path: str) -> ModelSource:
        if not isinstance(value, str):
            raise SpecError(path, f"must be a string, got {value!r}")
        if len(value) > 512:
            raise SpecError(path, f"must be at most 512 characters, got {len(value)}")
        if value.startswith("hf://"):
            try:  # the runtime's own rule for an adapter repository: hf://ORG/NAME, nothing more
                parse_hub_adapter(value)
            except ValueError as exc:
                raise SpecError(path, str(exc)) from None
        source = parse_model_source(value, path)
        if source.kind is SourceKind.PVC and not source.path:
            raise SpecError(
                path, f"{value!r} must name the adapter's directory on the claim (pvc://CLAIM/PATH)"
            )
        if source.kind is SourceKind.LOCAL and not source.path.startswith(f"{LORA_ROOT}/"):
            raise SpecError(
                path,
                f"{value!r}: an adapter in the image must lie under {LORA_ROOT}/ (the runtime's --lora-root)",
            )
        if source.kind is SourceKind.LOCAL and (source.path + "/").startswith(f"{CLAIMS_DIR}/"):
            raise SpecError(path, f"{value!r}: {CLAIMS_DIR}/ is where claims are mounted")
        return source


@dataclass(frozen=True)
class SectionList(Kind):
    """A list of objects, each a declared section (`of`), at most `max_items`."""

    of: Section
    max_items: int

    def schema(self) -> Schema:
        return self.node("")

    def node(self, name: str) -> Schema:
        item = self.of.node(name)
        return {"type": "array", "maxItems": self.max_items, "items": item}

    def crd_default(self, default: Any) -> Any:
        return None  # an empty list is left out of the stored object, as Kubernetes does

    def parse(self, value: Any, path: str) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise SpecError(path, "must be a list of objects")
        if len(value) > self.max_items:
            raise SpecError(path, f"may hold at most {self.max_items} items, got {len(value)}")
        return tuple(self.of.parse(item, f"{path}[{index}]") for index, item in enumerate(value))


@dataclass(frozen=True)
class LoraAdapter:
    name: str = spec_field(
        _served_name_kind(),
        "The adapter's served name: clients ask for it as `model`. Unique, not the base model's name.",
    )
    source: ModelSource = spec_field(
        AdapterSource(),
        "The adapter's PEFT directory (adapter_config.json, adapter_model.safetensors): "
        "pvc://CLAIM/PATH (the claim is mounted read-only), an absolute path under /adapters/ in the "
        "image, or hf://ORG/NAME (each pod downloads the two files, with spec.model.tokenSecretRef's token).",
    )
    rank: int = spec_field(
        Integer(1, max(LORA_RANKS)),
        "The adapter's rank (`r` in adapter_config.json); the largest declared rank sizes the "
        "runtime's slots (--max-lora-rank, rounded up to a size the runtime offers).",
    )
    revision: str | None = spec_field(
        String(min_length=1, max_length=255, pattern="^[^\\s]+$"),
        "A branch, tag or commit of the adapter's Hugging Face repository (hf:// only); unset means "
        "the default branch.",
        default=None,
    )

    @property
    def pod_path(self) -> str:
        """What the runtime loads: the adapter's directory inside the pod (under LORA_ROOT), or its
        hf://ORG/NAME source unchanged."""
        if self.source.kind is SourceKind.PVC:
            return f"{CLAIMS_DIR}/{self.source.claim}/{self.source.path}"
        if self.source.kind is SourceKind.HUGGING_FACE:
            return f"hf://{self.source.repo_id}"
        return self.source.path

    @property
    def served_root(self) -> str:
        """The `root` a pod's /v1/models gives the adapter once it serves this source: a hub
        adapter's `org/name[@revision]`, a directory's last part."""
        if self.source.kind is SourceKind.HUGGING_FACE:
            return HubAdapter(self.source.repo_id, self.revision).public_id
        return posixpath.basename(self.pod_path)


def _checked_adapter(adapter: LoraAdapter, path: str) -> None:
    if adapter.revision is not None and adapter.source.kind is not SourceKind.HUGGING_FACE:
        raise SpecError(f"{path}.revision", "a revision applies only to hf:// sources")


@dataclass(frozen=True)
class AliasTarget:
    adapter: str = spec_field(_served_name_kind(), "An adapter of spec.lora.")
    weight: int = spec_field(Integer(0, 100), "The share of the alias's requests it gets, in percent.")


@dataclass(frozen=True)
class LoraAlias:
    name: str = spec_field(
        _served_name_kind(),
        "The name clients ask for as `model`; the router sends each request to one target, chosen by weight.",
    )
    targets: tuple[AliasTarget, ...] = spec_field(
        SectionList(Section(AliasTarget), MAX_ALIAS_TARGETS),
        "The adapters behind the alias; the weights are whole percentages summing to 100.",
    )


def _checked_targets(alias: LoraAlias, path: str) -> None:
    if not alias.targets:
        raise SpecError(f"{path}.targets", "must name at least one adapter")
    if sum(target.weight for target in alias.targets) != 100:
        raise SpecError(f"{path}.targets", "the weights must sum to 100")
    names = [target.adapter for target in alias.targets]
    if len(set(names)) != len(names):
        raise SpecError(f"{path}.targets", "names an adapter twice")


ADAPTER = Section(LoraAdapter, check=_checked_adapter)
ALIAS = Section(LoraAlias, check=_checked_targets)


def check_lora(adapters: tuple[LoraAdapter, ...], aliases: tuple[LoraAlias, ...], base_name: str) -> None:
    """The rules between adapters, aliases and the base model (the CEL overlay states them too)."""
    names = [adapter.name for adapter in adapters]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise SpecError(f"spec.lora[{index}].name", f"{name!r} names two adapters")
        if name == base_name:
            raise SpecError(f"spec.lora[{index}].name", f"{name!r} is the base model's served name")
    seen: set[str] = set()
    for index, alias in enumerate(aliases):
        where = f"spec.loraAliases[{index}]"
        if alias.name in seen:
            raise SpecError(f"{where}.name", f"{alias.name!r} names two aliases")
        if alias.name in names or alias.name == base_name:
            raise SpecError(
                f"{where}.name", f"{alias.name!r} is already an adapter's or the base model's name"
            )
        seen.add(alias.name)
        for position, target in enumerate(alias.targets):
            if target.adapter not in names:
                raise SpecError(
                    f"{where}.targets[{position}].adapter",
                    f"{target.adapter!r} is not an adapter of spec.lora",
                )


def slot_rank(adapters: tuple[LoraAdapter, ...]) -> int:
    """The runtime's --max-lora-rank for these adapters: the smallest size it offers that holds the
    largest rank, and at least its default (16), so that adding an adapter of rank up to 16 never
    changes the pods."""
    largest = max((adapter.rank for adapter in adapters), default=1)
    return next(rank for rank in LORA_RANKS if rank >= max(largest, 16))


def claims(adapters: tuple[LoraAdapter, ...]) -> list[str]:
    """The claims the adapters live on, sorted (each is one read-only volume of the pod)."""
    return sorted({adapter.source.claim for adapter in adapters if adapter.source.kind is SourceKind.PVC})
