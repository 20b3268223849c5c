"""Write the generated part of the CRD into its files: the whole `spec` schema comes from the
declaration in `api/spec.py` (with `spec.autoscaling` from `autoscaler/policy.py` and the CEL
overlay of `api/cel_rules.py`); the rest of the CRD (names, printer columns, subresources, the
status schema) is written by hand. Both copies (crds/ and the chart's crds/) get the same text, and
the API reference is regenerated from it.

    python -m kvasir.operator.crd_sync          # rewrite the files
    python -m kvasir.operator.crd_sync --check  # exit 1 if they differ from the declaration

tests/operator/api/test_declaration.py fails when the committed files drift."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

from kvasir.operator import reference
from kvasir.operator.api.crd import spec_schema

CRD_NAME = "llmdeployments.inference.kvasir.dev.yaml"
CRD_FILES = (Path("crds") / CRD_NAME, Path("charts/kvasir/crds") / CRD_NAME)
REFERENCE = Path("docs/llmdeployment-reference.md")
# The plain manifests (scripts/render-deploy.sh renders them from the chart) hold a third copy; its
# spec schema is rewritten in place, so no Helm is needed here.
DEPLOY = Path("deploy/kvasir.yaml")
# The first indented `spec:` key of the file is the schema's (the CRD's own `spec:` is not indented).
BLOCK = re.compile(r"^(?P<indent> +)spec:\n", re.MULTILINE)


def _dump(node: dict[str, Any], indent: str) -> str:
    text = yaml.safe_dump(node, sort_keys=False, width=100, default_flow_style=False, allow_unicode=True)
    return "".join(f"{indent}  {line}\n" if line else "\n" for line in text.splitlines())


def with_generated(text: str) -> str:
    """The CRD's text with its `spec` schema replaced by the generated one."""
    match = BLOCK.search(text)
    if match is None:
        raise ValueError("the CRD has no spec schema")
    indent = match["indent"]
    end = match.end()
    lines = text[end:].splitlines(keepends=True)
    taken = 0
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip(" ")) <= len(indent):
            break
        taken += len(line)
    return text[:end] + _dump(spec_schema(), indent) + text[end + taken :]


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    source = CRD_FILES[0].read_text(encoding="utf-8")
    wanted = with_generated(source)
    crd = yaml.safe_load(wanted)
    docs = reference.render_reference(crd)
    targets = {path: wanted for path in CRD_FILES}
    targets[REFERENCE] = docs
    targets[DEPLOY] = with_generated(DEPLOY.read_text(encoding="utf-8"))
    stale = [path for path, text in targets.items() if path.read_text(encoding="utf-8") != text]
    if check:
        for path in stale:
            print(f"{path}: differs from the declaration; run python -m kvasir.operator.crd_sync")
        return 1 if stale else 0
    for path in stale:
        path.write_text(targets[path], encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
