"""`kvasir operator` as a process, given SIGTERM as a kubelet gives it on a pod's deletion: the
standby (waiting for the Lease) and the leader (running kopf) both stop cleanly, exit 0, and the
leader releases the Lease so the other replica takes over at once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.asyncio

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{{name: emulator, cluster: {{server: "{url}"}}}}]
users: [{{name: anyone, user: {{token: "x"}}}}]
contexts: [{{name: emulator, context: {{cluster: emulator, user: anyone}}}}]
current-context: emulator
"""


def _start(identity: str, kubeconfig: Path) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "kvasir.cli", "operator", "--identity", identity,
        "--lease-namespace", "kvasir-system", "--http-host", "127.0.0.1", "--http-port", "0",
    ]  # fmt: skip
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def _exit_code(process: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    output, _ = await asyncio.to_thread(process.communicate, None, timeout)
    return process.returncode, output


async def test_sigterm_stops_standby_and_leader_with_status_0(cluster, kt, tmp_path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(url=cluster.url))
    processes = {name: _start(name, kubeconfig) for name in ("pod-a", "pod-b")}
    try:

        def holder() -> Any:
            lease = cluster.get(kt.LEASES, "kvasir-operator", namespace="kvasir-system")
            return lease and lease["spec"].get("holderIdentity")

        leader = await cluster.wait(holder, what="one operator holding the Lease")
        standby = next(name for name in processes if name != leader)
        # The leader's kopf loop runs once it has listed LLMDeployments; the standby stands by once
        # it has asked for the Lease.
        await cluster.wait(
            lambda: any("llmdeployments" in str(r.url) for r in cluster.kmock), what="kopf's first list"
        )
        await cluster.wait(
            lambda: cluster.requests(agent=f"kvasir-operator (leader-election; {standby})"),
            what="the standby asking for the Lease",
        )

        processes[standby].send_signal(signal.SIGTERM)
        code, output = await _exit_code(processes[standby], kt.TIMEOUT)
        assert code == 0, output
        assert "Traceback" not in output, output

        processes[leader].send_signal(signal.SIGTERM)
        code, output = await _exit_code(processes[leader], kt.TIMEOUT)
        assert code == 0, output
        assert "Traceback" not in output and "stopped by itself" not in output, output
        # Handed over: the Lease names nobody, so a standby takes it without waiting out its term.
        assert not holder()
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
