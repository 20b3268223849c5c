"""`kvasir render`: the manifests the operator would create for LLMDeployment YAML, without a cluster.

An LLMDeployment is checked as `kubectl apply` would have the API server check it (unknown fields
refused, in the server's words) and then as the operator would parse it; objects of other kinds
are passed over, as the operator never sees them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvasir.operator import naming
from kvasir.operator.api.source import SpecError
from kvasir.operator.api.spec import parse_name, parse_spec
from kvasir.operator.api.strict_fields import unknown_object_fields
from kvasir.operator.children.manifests import build_children
from kvasir.operator.yaml_input import Document, InputError


@dataclass
class Rendered:
    """What a set of documents rendered to, and the other objects they held (for "nothing to render")."""

    manifests: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "Secret/name" of objects of other kinds


def render_documents(
    documents: Iterable[Document],
    *,
    namespace: str | None = None,
    with_service_monitor: bool = False,
    into: Rendered | None = None,
) -> Rendered:
    """Children of every LLMDeployment among `documents`; InputError (with the line) for the first
    one that the API server or the operator would refuse.

    Owner references are left out: they need the parent's uid, which only the API server assigns."""
    out = into or Rendered()
    for document in documents:
        obj = document.value
        if obj is None:  # an empty document, as between two `---`
            continue
        if not isinstance(obj, dict):
            raise InputError(f"expected a Kubernetes object (a mapping), got {_kind_of(obj)}", document.line)
        missing = [key for key in ("apiVersion", "kind") if not obj.get(key)]
        if missing:
            raise InputError(f"not a Kubernetes object: {' and '.join(missing)} not set", document.line)
        kind = obj["kind"]
        if str(kind).endswith("List") and isinstance(obj.get("items"), list):  # kubectl get -o yaml
            items = [document.child("items", i) for i in range(len(obj["items"]))]
            render_documents(items, namespace=namespace, with_service_monitor=with_service_monitor, into=out)
        elif kind != naming.KIND:
            name = obj.get("metadata", {}).get("name") if isinstance(obj.get("metadata"), dict) else None
            out.skipped.append(f"{kind}/{name}" if name else str(kind))
        else:
            out.manifests += _render_one(document, namespace, with_service_monitor)
    return out


def _render_one(
    document: Document, namespace: str | None, with_service_monitor: bool
) -> list[dict[str, Any]]:
    obj = document.value
    if obj.get("apiVersion") != naming.API_VERSION:
        message = f"expected {naming.API_VERSION}, got {obj.get('apiVersion')!r}"
        raise InputError(f"apiVersion: {message}", document.line_of("apiVersion") or document.line)
    unknown = unknown_object_fields(obj)
    if unknown:
        message = ", ".join(f'unknown field "{path}"' for path in unknown)
        raise InputError(message, document.line_of(unknown[0]) or document.line)
    try:
        meta = obj.get("metadata") or {}
        if not isinstance(meta, dict) or not meta.get("name"):
            raise SpecError("metadata.name", "is required")
        name = parse_name(meta["name"])
        ns = namespace or meta.get("namespace") or "default"
        spec = parse_spec(obj.get("spec") or {})
    except SpecError as exc:
        raise InputError(str(exc), document.line_of(exc.field) or document.line) from None
    return build_children(name, ns, spec, with_service_monitor=with_service_monitor)


def _kind_of(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"the value {value!r}"


class _PlainDumper(yaml.SafeDumper):
    """Never emit YAML anchors/aliases: the output is read by people and by GitOps diffs."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_manifests(manifests: list[dict[str, Any]]) -> str:
    """Multi-document YAML, one `---` per manifest."""
    return yaml.dump_all(manifests, Dumper=_PlainDumper, sort_keys=False, explicit_start=True)
