"""The programs some tests run besides Python (promtool, prometheus, helm): where they are, and
what happens when one is missing. scripts/setup-test-tools.sh installs them; scripts/test.sh sets
KVASIR_REQUIRE_TOOLS=1, so in CI a missing tool fails its tests instead of skipping them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def tool(name: str) -> str:
    """The path of `name` (on PATH, or in .tools/bin); skip the test, or fail it in CI, without it."""
    found = shutil.which(name) or shutil.which(name, path=str(REPO / ".tools" / "bin"))
    if found:
        return found
    message = f"{name} is not installed (scripts/setup-test-tools.sh installs it)"
    if os.environ.get("KVASIR_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)
