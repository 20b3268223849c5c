"""The simulator runs the operator's autoscaling policy, not its I/O: importing it loads neither
aiohttp, kopf nor the autoscaler's loop (a fresh interpreter, so other tests' imports don't count)."""

from __future__ import annotations

import subprocess
import sys


def test_the_simulator_imports_no_io_code() -> None:
    probe = (
        "import sys, kvasir.simulator.cli, kvasir.simulator.config\n"
        "loaded = [m for m in ('aiohttp', 'kopf', 'kvasir.operator.autoscaler.loop', 'kvasir.operator.kube') if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == ""
