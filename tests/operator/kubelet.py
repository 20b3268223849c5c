"""A stand-in for the kubelet and the ReplicaSet controller, for closed-loop autoscaling tests:
it runs one real `kvasir serve` process per replica the Deployment asks for, each on its own
loopback address (as pods have their own IPs), and reports them in the emulated API server as
Pods that turn Ready when the runtime's /ready does.

Scaling down follows Kubernetes: the pod with the lowest `controller.kubernetes.io/pod-deletion-cost`
goes first; it is marked for deletion (the load balancer stops sending to it, as the endpoints
controller would), then after a short preStop pause gets SIGTERM, drains and exits, and only then
disappears. `Balancer` stands in for the Service: round-robin over ready, not-deleting pods."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

PRESTOP_SECONDS = 0.5
KUBELET_FINALIZER = "kvasir.test/kubelet"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodProcess:
    name: str
    ip: str
    process: subprocess.Popen[bytes]
    ready: bool = False
    deleting: bool = False


@dataclass
class Kubelet:
    cluster: Any
    kt: Any
    checkpoint: Path
    port: int
    deployment: str = "demo"
    serve_args: tuple[str, ...] = ()
    pods: dict[str, PodProcess] = field(default_factory=dict)
    started: int = 0
    _task: asyncio.Task[None] | None = None
    _deletions: set[asyncio.Task[None]] = field(default_factory=set)

    def _spawn(self) -> None:
        self.started += 1
        name = f"{self.deployment}-{self.started}"
        ip = f"127.0.1.{self.started}"
        command = [
            sys.executable, "-m", "kvasir.cli", "serve",
            "--model", str(self.checkpoint), "--served-model-name", "tiny",
            "--host", ip, "--port", str(self.port), "--device", "cpu",
            *self.serve_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pods[name] = PodProcess(name, ip, process)

    async def _create_pod(self, pod: PodProcess) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod.name,
                "namespace": self.kt.NS,
                "labels": {"app.kubernetes.io/name": "kvasir", "app.kubernetes.io/instance": self.deployment},
                "creationTimestamp": _now(),
            },
            "status": {
                "podIP": pod.ip,
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _now()}],
            },
        }
        await self.cluster.create(self.kt.PODS, body)

    async def _probe(self, session: aiohttp.ClientSession, pod: PodProcess) -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with session.get(f"http://{pod.ip}:{self.port}/ready") as response:
                if response.status == 200 and not pod.ready:
                    pod.ready = True
                    ready = {
                        "status": {
                            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": _now()}]
                        }
                    }
                    await self.cluster.patch(self.kt.PODS, pod.name, ready, sub="status")

    def _deletion_cost(self, pod: PodProcess) -> int:
        stored = self.cluster.get(self.kt.PODS, pod.name) or {}
        annotations = (stored.get("metadata") or {}).get("annotations") or {}
        return int(annotations.get("controller.kubernetes.io/pod-deletion-cost", "0"))

    async def _delete(self, pod: PodProcess) -> None:
        pod.deleting = True
        # Graceful deletion: the object stays (here held by a finalizer) until the process is gone.
        marked = {"metadata": {"deletionTimestamp": _now(), "finalizers": [KUBELET_FINALIZER]}}
        await self.cluster.patch(self.kt.PODS, pod.name, marked)
        await asyncio.sleep(PRESTOP_SECONDS)  # preStop: the endpoints forget the pod first
        pod.process.send_signal(signal.SIGTERM)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=1)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                deployment = self.cluster.get(self.kt.DEPLOYMENTS, self.deployment)
                want = int(((deployment or {}).get("spec") or {}).get("replicas") or 0)
                alive = [p for p in self.pods.values() if not p.deleting]
                for _ in range(want - len(alive)):
                    self._spawn()
                    await self._create_pod(list(self.pods.values())[-1])
                if len(alive) > want:
                    # The ReplicaSet's choice: not-ready pods first, then the lowest deletion cost.
                    ranked = sorted(alive, key=lambda p: (p.ready, self._deletion_cost(p)))
                    for pod in ranked[: len(alive) - want]:
                        task = asyncio.ensure_future(self._delete(pod))
                        self._deletions.add(task)
                        task.add_done_callback(self._deletions.discard)
                for pod in list(self.pods.values()):
                    if pod.deleting and pod.process.poll() is not None:
                        # Releasing the finalizer lets the emulator remove the object.
                        await self.cluster.patch(self.kt.PODS, pod.name, {"metadata": {"finalizers": []}})
                        del self.pods[pod.name]
                    elif not pod.deleting and not pod.ready:
                        await self._probe(session, pod)
                await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for pod in self.pods.values():
            if pod.process.poll() is None:
                pod.process.kill()
            pod.process.wait(timeout=10)

    @property
    def serving(self) -> list[PodProcess]:
        return [p for p in self.pods.values() if p.ready and not p.deleting]


@dataclass
class Balancer:
    """The Service: each request goes to the next ready pod that is not being deleted."""

    kubelet: Kubelet
    _next: int = 0

    def pick(self) -> str | None:
        serving = self.kubelet.serving
        if not serving:
            return None
        self._next += 1
        pod = serving[self._next % len(serving)]
        return f"http://{pod.ip}:{self.kubelet.port}"
