"""Markdown reference of the LLMDeployment API, generated from the CRD (the schema's source of truth).

    python -m kvasir.operator.reference crds/llmdeployments.inference.kvasir.dev.yaml \
        > docs/llmdeployment-reference.md
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import yaml

HEADER = """# LLMDeployment reference

<!-- Generated from the spec's declaration (operator/api/spec.py) by `python -m kvasir.operator.crd_sync`;
     do not edit by hand: tests/operator/test_reference_docs.py fails when it drifts from the CRD. -->

`{group}/{version}`, kind `{kind}`, short name `{short}`, namespaced. See the
[user guide](user-guide.md) for how to apply, inspect, scale and delete one.

{description}

"""


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = str(node.get("type", "any"))
    if kind == "array":
        return f"array of {_type(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type(node['additionalProperties'])}"
    return kind


def _constraints(node: dict[str, Any]) -> str:
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in node["enum"]))
    if "minimum" in node:
        parts.append(f"≥ {node['minimum']}")
    if "maximum" in node:
        parts.append(f"≤ {node['maximum']}")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    if "maxLength" in node:
        parts.append(f"at most {node['maxLength']} characters")
    if "maxItems" in node:
        parts.append(f"at most {node['maxItems']} items")
    return "; ".join(parts)


def _rows(node: dict[str, Any], path: str, required: bool) -> Iterator[str]:
    default = f"`{json.dumps(node['default'])}`" if "default" in node else ""
    description = " ".join(str(node.get("description", "")).split())
    cells = [f"`{path}`", _type(node), "yes" if required else "", default, _constraints(node), description]
    yield "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
    needed = set(node.get("required") or [])
    for key, child in (node.get("properties") or {}).items():
        yield from _rows(child, f"{path}.{key}", key in needed)
    items = node.get("items")
    if isinstance(items, dict) and items.get("properties"):
        for key, child in items["properties"].items():
            yield from _rows(child, f"{path}[].{key}", key in set(items.get("required") or []))


def _rules(node: dict[str, Any], path: str) -> Iterator[str]:
    for rule in node.get("x-kubernetes-validations") or []:
        expression = rule["rule"].replace("|", "\\|")
        yield f"| `{path or '.'}` | `{expression}` | {rule['message']} |"
    for key, child in (node.get("properties") or {}).items():
        yield from _rules(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _rules(node["items"], f"{path}[]")


def render_reference(crd: dict[str, Any]) -> str:
    """The whole reference page for one CRD (its first version)."""
    spec = crd["spec"]
    version = spec["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    out = [
        HEADER.format(
            group=spec["group"],
            version=version["name"],
            kind=spec["names"]["kind"],
            short=", ".join(spec["names"].get("shortNames", [])),
            description=" ".join(schema.get("description", "").split()),
        )
    ]
    table = "| field | type | required | default | constraints | description |\n|---|---|---|---|---|---|"
    for section in ("spec", "status"):
        node = schema["properties"][section]
        out.append(f"## .{section}\n\n{' '.join(node.get('description', '').split())}\n\n{table}")
        for key, child in node.get("properties", {}).items():
            out.extend(_rows(child, f".{section}.{key}", key in set(node.get("required") or [])))
        out.append("")
    out.append("## Validation rules (CEL)\n\nChecked by the API server on every create and update.\n")
    out.append("| at | rule | message |\n|---|---|---|")
    out.extend(_rules(schema, ""))
    out.append("\n## Printer columns\n\n| column | value |\n|---|---|")
    for column in version.get("additionalPrinterColumns", []):
        out.append(f"| {column['name']} | `{column['jsonPath']}` |")
    scale = version["subresources"].get("scale", {})
    out.append(
        "\n## Subresources\n\n`status`, and `scale` (`kubectl scale llmd/NAME --replicas=N`, HPA, KEDA): "
        f"spec `{scale.get('specReplicasPath')}`, status `{scale.get('statusReplicasPath')}`, "
        f"selector `{scale.get('labelSelectorPath')}`.\n"
    )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as handle:
        sys.stdout.write(render_reference(yaml.safe_load(handle)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
