"""Write the generated parts of the CRD into its files: `spec.autoscaling` comes from the
declaration in `autoscaler/policy.py`; the rest of the CRD is written by hand. Both copies (crds/
and the chart's crds/) get the same text, and the API reference is regenerated from it.

    python -m kvasir.operator.crd_sync          # rewrite the files
    python -m kvasir.operator.crd_sync --check  # exit 1 if they differ from the declaration

tests/operator/test_crd_declaration.py fails when the committed files drift."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

from kvasir.operator import reference
from kvasir.operator.autoscaler.policy import autoscaling_schema

CRD_NAME = "llmdeployments.inference.kvasir.dev.yaml"
CRD_FILES = (Path("crds") / CRD_NAME, Path("charts/kvasir/crds") / CRD_NAME)
REFERENCE = Path("docs/llmdeployment-reference.md")
# The first `autoscaling:` key of the file is spec.autoscaling (status.autoscaling comes later).
BLOCK = re.compile(r"^(?P<indent> +)autoscaling:\n", re.MULTILINE)


def _dump(node: dict[str, Any], indent: str) -> str:
    text = yaml.safe_dump(node, sort_keys=False, width=100, default_flow_style=False, allow_unicode=True)
    return "".join(f"{indent}  {line}\n" if line else "\n" for line in text.splitlines())


def with_generated(text: str) -> str:
    """The CRD's text with its `spec.autoscaling` block replaced by the generated one."""
    match = BLOCK.search(text)
    if match is None:
        raise ValueError("the CRD has no autoscaling block")
    indent = match["indent"]
    end = match.end()
    lines = text[end:].splitlines(keepends=True)
    taken = 0
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip(" ")) <= len(indent):
            break
        taken += len(line)
    return text[:end] + _dump(autoscaling_schema(), indent) + text[end + taken :]


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    source = CRD_FILES[0].read_text(encoding="utf-8")
    wanted = with_generated(source)
    crd = yaml.safe_load(wanted)
    docs = reference.render_reference(crd)
    stale = [str(path) for path in CRD_FILES if path.read_text(encoding="utf-8") != wanted]
    if REFERENCE.read_text(encoding="utf-8") != docs:
        stale.append(str(REFERENCE))
    if check:
        for path in stale:
            print(f"{path}: differs from the declaration; run python -m kvasir.operator.crd_sync")
        return 1 if stale else 0
    for crd_file in CRD_FILES:
        crd_file.write_text(wanted, encoding="utf-8")
    REFERENCE.write_text(docs, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
