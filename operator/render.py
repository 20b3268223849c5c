"""`kvasir render`: the manifests the operator would create for LLMDeployment YAML, without a cluster."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

from kvasir.operator import naming
from kvasir.operator.manifests import build_children
from kvasir.operator.source import SpecError
from kvasir.operator.spec import parse_name, parse_spec


def render_documents(
    documents: Iterable[Any], *, namespace: str | None = None, with_service_monitor: bool = False
) -> list[dict[str, Any]]:
    """Children of every LLMDeployment among `documents` (other kinds are skipped); SpecError if invalid.

    Owner references are left out: they need the parent's uid, which only the API server assigns."""
    manifests: list[dict[str, Any]] = []
    for doc in documents:
        if not isinstance(doc, dict) or doc.get("kind") != naming.KIND:
            continue
        if doc.get("apiVersion") != naming.API_VERSION:
            raise SpecError("apiVersion", f"expected {naming.API_VERSION}, got {doc.get('apiVersion')!r}")
        meta = doc.get("metadata") or {}
        name = meta.get("name")
        if not name:
            raise SpecError("metadata.name", "is required")
        parse_name(name)
        ns = namespace or meta.get("namespace") or "default"
        spec = parse_spec(doc.get("spec") or {})
        manifests += build_children(name, ns, spec, with_service_monitor=with_service_monitor)
    return manifests


class _PlainDumper(yaml.SafeDumper):
    """Never emit YAML anchors/aliases: the output is read by people and by GitOps diffs."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_yaml(text: str, *, namespace: str | None = None, with_service_monitor: bool = False) -> str:
    """Multi-document YAML in, multi-document YAML out."""
    documents = list(yaml.safe_load_all(text))
    manifests = render_documents(documents, namespace=namespace, with_service_monitor=with_service_monitor)
    return yaml.dump_all(manifests, Dumper=_PlainDumper, sort_keys=False, explicit_start=True)
