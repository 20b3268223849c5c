"""The API server's strict field validation for LLMDeployments, without a cluster: the fields the
CRD's structural schema does not declare (the server prunes them, and `kubectl apply` refuses them
with `strict decoding error: unknown field "spec.replicsa"`).

The schema is read from the CRD itself, shipped inside the package (`kvasir.crds`, the very file
in crds/), so there is one declaration of the API and nothing here to keep in step with it."""

from __future__ import annotations

import functools
import importlib
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from kvasir.operator import naming

CRD_FILE = f"{naming.PLURAL}.{naming.GROUP}.yaml"

# metadata is ObjectMeta, which a CRD's schema never spells out; the API server decodes it as one.
OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    }
)


def package_text(package: str, name: str) -> str:
    """The text of data file `name` shipped in `package`, however the package was installed.

    `kvasir.crds` holds data only, so it is a namespace package, and importlib.resources reads
    one through a MultiplexedPath of every entry of its `__path__`, which must all be folders. A
    plain editable install (`pip install -e .`, setuptools' lenient mode) adds its finder's path
    hook there, a name that is no folder: `files()` then raises NotADirectoryError. The folders
    among the entries are read directly in that case."""
    try:
        return files(package).joinpath(name).read_text(encoding="utf-8")
    except NotADirectoryError:
        pass
    for entry in importlib.import_module(package).__path__:
        path = Path(entry) / name
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise FileNotFoundError(f"{name} is not in package {package}")


def load_crd() -> dict[str, Any]:
    """The LLMDeployment CustomResourceDefinition, as shipped."""
    text = package_text("kvasir.crds", CRD_FILE)
    crd: dict[str, Any] = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return crd


@functools.cache
def object_schema() -> dict[str, Any]:
    """The served version's openAPIV3Schema (the whole object: apiVersion, kind, metadata, spec, status)."""
    for version in load_crd()["spec"]["versions"]:
        if version["name"] == naming.VERSION:
            schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
            return schema
    raise LookupError(f"{CRD_FILE} serves no version {naming.VERSION}")


def unknown_fields(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths (`spec.scheduling.tolerations[0].foo`) of the fields in `value` that `schema` would
    prune: a key an object's `properties` lack, unless the node preserves unknown fields or is a
    map (`additionalProperties`). Values of the wrong type are left to type validation."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        found = []
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if props is not None and key in props:
                found += unknown_fields(item, props[key], where)
            elif isinstance(extra, dict):
                found += unknown_fields(item, extra, where)
            elif extra is not True and props is not None:
                found.append(where)
        return found
    if isinstance(value, list) and "items" in schema:
        return [
            p for i, item in enumerate(value) for p in unknown_fields(item, schema["items"], f"{path}[{i}]")
        ]
    return []


def unknown_object_fields(obj: dict[str, Any]) -> list[str]:
    """Unknown fields of a whole LLMDeployment: the schema's (in the order written), then metadata's."""
    found = unknown_fields(obj, object_schema())
    metadata = obj.get("metadata")
    if isinstance(metadata, dict):
        found += [f"metadata.{key}" for key in metadata if key not in OBJECT_META_FIELDS]
    return found
