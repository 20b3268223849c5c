"""Which parts of a child the operator owns, and how a desired child is merged into the live one.

The write model is controller-runtime's CreateOrUpdate: read the live object, overwrite the
subtrees the operator owns with what the spec asks for now (so a field removed from the spec
disappears from the child), keep everything else as the API server and other controllers left it,
and PUT the result with the live `resourceVersion` (a concurrent writer gets 409, and we retry on
fresh state). Server-side apply is not used: an object first created with POST and later applied
under the same manager cannot have fields removed (kubernetes#107417), and the emulator the tests
run against has no server-side apply to prove otherwise.

Labels and annotations are shared with other tools (kubectl, service meshes, cloud controllers),
so there the operator owns keys, not the whole map: it records the keys it set in the
`kvasir.dev/applied` annotation and removes only those it no longer wants. The same record holds a
hash of the desired content, which tells a spec change (write) from server defaults (no write).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

APPLIED_ANNOTATION = "kvasir.dev/applied"


@dataclass(frozen=True)
class Ownership:
    """The top-level `spec` keys one kind of child has overwritten on every write (None: all of it)."""

    spec_keys: tuple[str, ...] | None
    # Top-level keys besides `spec` owned whole (RBAC objects keep their content there).
    top_keys: tuple[str, ...] = ()
    # Keys of `spec.template.metadata.annotations` are shared, not owned: `kubectl rollout restart`
    # writes one there, and overwriting it would undo the restart.
    shares_template_annotations: bool = False


# A Deployment's `paused` (kubectl rollout pause) is left to users; everything that shapes the pods
# and the rollout is the operator's. A Service's clusterIP, ipFamilies, nodePorts... are the API
# server's: only type, selector and ports are ours.
OWNERSHIP = {
    "Deployment": Ownership(
        (
            "replicas",
            "selector",
            "strategy",
            "template",
            "progressDeadlineSeconds",
            "revisionHistoryLimit",
            "minReadySeconds",
        ),
        shares_template_annotations=True,
    ),
    "Service": Ownership(("type", "selector", "ports")),
    # A multi-node group: its size, templates, rollout and start-up are ours; networkConfig and
    # what LWS's webhook defaults in are the server's.
    "LeaderWorkerSet": Ownership(("replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy")),
    "PodDisruptionBudget": Ownership(None),
    "ServiceMonitor": Ownership(None),
    "InferencePool": Ownership(None),
    # The router's account, its Role and RoleBinding: no spec; their labels, rules and binding are
    # ours (a ServiceAccount's secrets and imagePullSecrets are left to others).
    "ServiceAccount": Ownership(()),
    "Role": Ownership((), top_keys=("rules",)),
    "RoleBinding": Ownership((), top_keys=("roleRef", "subjects")),
    # spec.lora's ConfigMap: its data is the declared set, whole.
    "ConfigMap": Ownership((), top_keys=("data",)),
}


@dataclass(frozen=True)
class AppliedRecord:
    """What the operator last wrote to a child: a hash of it and the shared-map keys it set."""

    digest: str = ""
    labels: tuple[str, ...] = ()
    annotations: tuple[str, ...] = ()
    template_annotations: tuple[str, ...] = ()

    def encode(self) -> str:
        return json.dumps(
            {
                "hash": self.digest,
                "labels": list(self.labels),
                "annotations": list(self.annotations),
                "templateAnnotations": list(self.template_annotations),
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, text: str | None) -> AppliedRecord:
        """The record stored on a child; an empty record if absent or unreadable (then we rewrite)."""
        try:
            data = json.loads(text or "{}")
            return cls(
                digest=str(data.get("hash") or ""),
                labels=tuple(str(k) for k in data.get("labels") or ()),
                annotations=tuple(str(k) for k in data.get("annotations") or ()),
                template_annotations=tuple(str(k) for k in data.get("templateAnnotations") or ()),
            )
        except (ValueError, AttributeError, TypeError):
            return cls()


def digest(value: Any) -> str:
    """A short, stable hash of a JSON value (key order does not matter)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _template_annotations(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    template = (obj.get("spec") or {}).get("template") or {}
    return (template.get("metadata") or {}).get("annotations") or {}


def record_for(desired: Mapping[str, Any]) -> AppliedRecord:
    """The record a write of `desired` leaves behind."""
    meta = desired.get("metadata") or {}
    ownership = OWNERSHIP[desired["kind"]]
    template_keys = _template_annotations(desired) if ownership.shares_template_annotations else {}
    return AppliedRecord(
        digest=digest(desired),
        labels=tuple(sorted(meta.get("labels") or {})),
        annotations=tuple(sorted(meta.get("annotations") or {})),
        template_annotations=tuple(sorted(template_keys)),
    )


def applied_record(live: Mapping[str, Any]) -> AppliedRecord:
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    return AppliedRecord.decode(annotations.get(APPLIED_ANNOTATION))


def _merge_keys(
    live: Mapping[str, Any] | None, desired: Mapping[str, Any] | None, previously_ours: tuple[str, ...]
) -> dict[str, Any]:
    """Others' keys kept, keys we set before but want no more removed, ours set."""
    wanted = dict(desired or {})
    merged = {k: v for k, v in (live or {}).items() if k not in previously_ours and k not in wanted}
    merged.update(wanted)
    return merged


def _merge_owner_references(
    live: list[Mapping[str, Any]] | None, desired: list[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    ours = [dict(ref) for ref in desired or []]
    uids = {ref.get("uid") for ref in ours}
    others = [dict(ref) for ref in live or [] if ref.get("uid") not in uids and not ref.get("controller")]
    return others + ours


def merge_into_live(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The body to PUT: the live object with every owned part replaced by the desired one."""
    ownership = OWNERSHIP[desired["kind"]]
    previous = applied_record(live)
    record = record_for(desired)
    body = copy.deepcopy(dict(live))
    body.pop("status", None)  # the status subresource ignores it on PUT anyway
    meta = body.setdefault("metadata", {})
    meta.pop("managedFields", None)  # omitted: the server keeps them as they are
    want = desired.get("metadata") or {}
    meta["labels"] = _merge_keys(meta.get("labels"), want.get("labels"), previous.labels)
    annotations = _merge_keys(meta.get("annotations"), want.get("annotations"), previous.annotations)
    annotations[APPLIED_ANNOTATION] = record.encode()
    meta["annotations"] = annotations
    meta["ownerReferences"] = _merge_owner_references(
        meta.get("ownerReferences"), want.get("ownerReferences")
    )
    live_spec = dict(body.get("spec") or {})
    desired_spec = copy.deepcopy(dict(desired.get("spec") or {}))
    if ownership.spec_keys is None:
        spec = desired_spec
    else:
        spec = {k: v for k, v in live_spec.items() if k not in ownership.spec_keys}
        spec.update({k: v for k, v in desired_spec.items() if k in ownership.spec_keys})
    if ownership.shares_template_annotations and "template" in spec:
        template_meta = spec["template"].setdefault("metadata", {})
        template_meta["annotations"] = _merge_keys(
            _template_annotations(live), template_meta.get("annotations"), previous.template_annotations
        )
    if spec or "spec" in desired or "spec" in live:
        body["spec"] = spec
    for key in ownership.top_keys:
        if key in desired:
            body[key] = copy.deepcopy(desired[key])
        else:
            body.pop(key, None)
    return body


def with_record(desired: Mapping[str, Any]) -> dict[str, Any]:
    """`desired` with its applied record, as sent on creation."""
    body = copy.deepcopy(dict(desired))
    meta = body.setdefault("metadata", {})
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        APPLIED_ANNOTATION: record_for(desired).encode(),
    }
    return body


def contains(live: Any, desired: Any) -> bool:
    """Whether `live` has every field of `desired` with the same value; extra live fields are the
    server's defaults. An empty desired list or map matches a missing one (Go's omitempty drops them)."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return not desired and live is None
        return all(
            contains(live[key], value) if key in live else _empty(value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        if live is None:
            return not desired
        if not isinstance(live, list) or len(live) != len(desired):
            return False
        return all(contains(a, b) for a, b in zip(live, desired, strict=True))
    if isinstance(desired, bool) or isinstance(live, bool):
        return live is desired
    if isinstance(desired, (int, float)) and isinstance(live, (int, float)):
        return float(live) == float(desired)
    return bool(live == desired)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (Mapping, list)) and not value)


def owned_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of an object the operator owns (for comparisons and the settled cache)."""
    ownership = OWNERSHIP[obj["kind"]]
    spec = dict(obj.get("spec") or {})
    if ownership.spec_keys is not None:
        spec = {k: v for k, v in spec.items() if k in ownership.spec_keys}
    meta = obj.get("metadata") or {}
    return {
        "labels": meta.get("labels") or {},
        "annotations": meta.get("annotations") or {},
        "ownerReferences": meta.get("ownerReferences") or [],
        "spec": spec,
        "top": {key: obj.get(key) for key in ownership.top_keys},
    }


def _owner_references_present(live: list[Any], desired: list[Any]) -> bool:
    by_uid = {ref.get("uid"): ref for ref in live if isinstance(ref, Mapping)}
    return all(contains(by_uid.get(ref.get("uid")), ref) for ref in desired)


def owned_spec_digest(obj: Mapping[str, Any]) -> str:
    """A hash of the owned spec as stored, to recognise a child nobody touched since our write."""
    return digest(owned_view(obj)["spec"])


def up_to_date(live: Mapping[str, Any], desired: Mapping[str, Any], settled_spec: str | None = None) -> bool:
    """Whether writing `desired` would change nothing the operator owns.

    The spec we last wrote must be the one we want now (the hash in the applied record: this is how
    a field removed from the spec is noticed), and the live object must still hold every owned
    value (this is how another writer's edit is noticed). `settled_spec` is the owned spec's hash
    as the server answered our last write: when the server normalised a value in a way the
    builders cannot express, the live object equal to that answer is up to date too (no write loop)."""
    if applied_record(live).digest != record_for(desired).digest:
        return False
    have, want = owned_view(live), owned_view(desired)
    if not (contains(have["labels"], want["labels"]) and contains(have["annotations"], want["annotations"])):
        return False
    if not _owner_references_present(have["ownerReferences"], want["ownerReferences"]):
        return False
    if not contains(have["top"], want["top"]):
        return False
    if contains(have["spec"], want["spec"]):
        return True
    return settled_spec is not None and settled_spec == owned_spec_digest(live)
