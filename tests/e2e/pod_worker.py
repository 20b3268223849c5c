"""One pod bound to the node, from first sight to its removal from the API server: either a stand-in
that turns Ready at once, or (process mode) a real Kvasir process that is probed, restarted when it
exits and stopped gracefully when the pod is deleted, as a kubelet would."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.e2e import probes
from tests.e2e.host import Host
from tests.e2e.kube_client import MERGE_PATCH, ApiError
from tests.e2e.kubeconfig import write_token_kubeconfig
from tests.e2e.node_objects import now
from tests.e2e.pod_launch import ConfigError, command_for, kvasir_role, resolve_env
from tests.e2e.pod_status import Conditions, Container, pod_status

log = logging.getLogger("tests.e2e.node_agent")

BACKOFF_FIRST = 0.5  # seconds; a kubelet starts at 10 s, far too slow for tests
BACKOFF_MAX = 4.0
BACKOFF_RESET = 60.0  # a process that ran this long starts the next back-off from the beginning
CONFIG_RETRY = 1.0  # how soon a missing Secret is looked for again
PRESTOP_CAP = 1.0  # preStop sleeps are cut to this, to keep the tests fast
TICK = 0.2  # how often a running process is checked for having exited
WRITE_ATTEMPTS = 5
TOKEN_SECONDS = 24 * 3600

API_ERRORS = (ApiError, aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _exit_code(returncode: int) -> int:
    """Popen says -N for signal N; container runtimes say 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _stand_in(spec: dict[str, Any]) -> Container:
    container = Container(spec["name"], spec.get("image", ""))
    container.run(started=True)
    container.ready = True
    return container


class PodWorker:
    """Runs one pod (`run()`); the node agent feeds it the pod's watch events (`update`, `removed`)."""

    def __init__(self, host: Host, pod: dict[str, Any]) -> None:
        self.host = host
        metadata = pod["metadata"]
        self.namespace, self.name, self.uid = metadata["namespace"], metadata["name"], metadata["uid"]
        self.path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"
        self.deleting = asyncio.Event()
        self.gone = asyncio.Event()
        self.ip = ""
        self.start_time = now()
        self.conditions = Conditions()
        self._written: dict[str, Any] | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.pod = pod
        self.update(pod)

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.deleting.set()

    def removed(self) -> None:
        """The object is gone from the API server (deleted by the agent, or forcibly by someone else)."""
        self.gone.set()
        self.deleting.set()

    async def run(self) -> None:
        if (self.pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            await self._finish(None, {})
            return
        self.ip = self.host.ips.take()
        try:
            role = kvasir_role(self.pod) if self.namespace in self.host.process_namespaces else None
            if role is None:
                await self._run_stand_in()
            else:
                await self._run_process(role)
        finally:
            self._kill()
            self.host.ips.give_back(self.ip)

    # -- the two modes ------------------------------------------------------------------------

    async def _run_stand_in(self) -> None:
        """Ready at once, unless a container's Secret or ConfigMap is missing: then it waits in
        CreateContainerConfigError, as a kubelet's container would, until the object appears."""
        specs = self.pod["spec"]["containers"]
        while not self.deleting.is_set():
            problem = await self._config_problem(specs)
            if problem is None:
                await self._write("Running", [_stand_in(spec) for spec in specs])
                break
            index, message = problem
            waiting = [Container(spec["name"], spec.get("image", "")) for spec in specs]
            waiting[index].wait("CreateContainerConfigError", message)
            await self._write("Pending", waiting)
            await self._pause(CONFIG_RETRY)
        await self._finish(None, {})

    async def _config_problem(self, specs: list[dict[str, Any]]) -> tuple[int, str] | None:
        """The first container whose environment cannot be resolved, with the kubelet's message."""
        for index, container in enumerate(specs):
            try:
                await resolve_env(self.pod, container, self.ip, self._read)
            except (ConfigError, ApiError) as error:
                return index, str(error)
        return None

    async def _run_process(self, role: str) -> None:
        spec = self.pod["spec"]
        container = spec["containers"][0]
        main = Container(container["name"], container.get("image", ""))
        every = [main, *(_stand_in(other) for other in spec["containers"][1:])]
        await self._write("Pending", every)
        process: subprocess.Popen[bytes] | None = None
        backoff = BACKOFF_FIRST
        while not self.deleting.is_set():
            try:
                command, env = await self._prepare(role, container)
            except ConfigError as error:
                main.wait("CreateContainerConfigError", str(error))
                await self._write("Pending" if process is None else "Running", every)
                await self._pause(CONFIG_RETRY)
                continue
            process = self._spawn(command, env)
            began = time.monotonic()
            main.run(started="startupProbe" not in container)
            await self._write("Running", every)
            await self._supervise(process, main, container, every)
            if process.poll() is None:
                break  # deletion asked for: terminated below
            code = _exit_code(process.returncode)
            log.info("%s/%s: process exited with %d", self.namespace, self.name, code)
            main.exit(code, self.uid)
            policy = spec.get("restartPolicy", "Always")
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                await self._write("Succeeded" if code == 0 else "Failed", every)
                break
            if time.monotonic() - began > BACKOFF_RESET:
                backoff = BACKOFF_FIRST
            main.back_off(
                f"back-off {backoff:g}s restarting failed container={main.name} "
                f"pod={self.name}_{self.namespace}({self.uid})"
            )
            await self._write("Running", every)
            await self._pause(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)
        await self._finish(process, container)

    async def _supervise(
        self,
        process: subprocess.Popen[bytes],
        main: Container,
        container: dict[str, Any],
        every: list[Container],
    ) -> None:
        """Probe until the process exits or deletion is asked for; status written on each change."""
        startup, readiness = container.get("startupProbe"), container.get("readinessProbe")
        due = 0.0
        async with aiohttp.ClientSession() as http:
            while process.poll() is None and not self.deleting.is_set():
                if time.monotonic() >= due:
                    if not main.started and startup is not None:
                        main.started = await probes.passes(http, startup, container, self.ip)
                    if main.started:
                        main.ready = readiness is None or await probes.passes(
                            http, readiness, container, self.ip
                        )
                    due = time.monotonic() + probes.period(readiness if main.started else startup)
                    if process.poll() is None:
                        await self._write("Running", every)
                await self._pause(TICK)

    # -- starting ------------------------------------------------------------------------------

    async def _read(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self.host.client.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/{kind}/{name}"
            )
            return found
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def _prepare(self, role: str, container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        try:
            env = await resolve_env(self.pod, container, self.ip, self._read)
            if role == "operator":
                # A process here cannot read an in-cluster token file: it gets a kubeconfig with the
                # same kind of token the kubelet would project, for the pod's ServiceAccount.
                env["KUBECONFIG"] = str(await self._service_account_kubeconfig())
        except ApiError as error:
            raise ConfigError(str(error)) from error
        return command_for(role, container, self.ip), env

    async def _service_account_kubeconfig(self) -> Path:
        account = self.pod["spec"].get("serviceAccountName") or "default"
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_SECONDS},
        }
        answer = await self.host.client.request(
            "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token", request
        )
        return write_token_kubeconfig(
            self.host.credentials_path(self.namespace, self.name),
            self.host.access,
            answer["status"]["token"],
            f"system:serviceaccount:{self.namespace}:{account}",
        )

    def _spawn(self, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        path = self.host.log_path(self.namespace, self.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as output:
            output.write(f"==> {now()} node agent starts: {shlex.join(command)}\n".encode())
            output.flush()
            # Its own process group: stopping the "container" kills whatever the process started too.
            process = subprocess.Popen(
                command,
                env=env,
                cwd=self.host.log_dir,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._process = process
        with self.host.lock:
            self.host.processes[(self.namespace, self.name)] = process
        log.info("%s/%s: started pid %d at %s", self.namespace, self.name, process.pid, self.ip)
        return process

    # -- stopping ------------------------------------------------------------------------------

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less if deletion is asked for meanwhile."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.deleting.wait(), seconds)

    async def _finish(self, process: subprocess.Popen[bytes] | None, container: dict[str, Any]) -> None:
        """Wait for deletion, stop the process gracefully, then remove the pod object."""
        await self.deleting.wait()
        if process is not None:
            await self._terminate(process, container)
        if not self.gone.is_set():
            await self._delete()

    async def _terminate(self, process: subprocess.Popen[bytes], container: dict[str, Any]) -> None:
        """preStop sleep (capped), SIGTERM, SIGKILL when the grace period (which includes the preStop
        pause, as in a kubelet) runs out or the object is force-deleted."""
        if process.poll() is not None:
            return
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        deadline = time.monotonic() + float(grace)
        pause = (((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds")
        if pause and not self.gone.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.gone.wait(), min(float(pause), PRESTOP_CAP, float(grace)))
        if not self.gone.is_set() and process.poll() is None:
            log.info("%s/%s: SIGTERM to pid %d (grace %ss)", self.namespace, self.name, process.pid, grace)
            process.send_signal(signal.SIGTERM)
        while process.poll() is None and time.monotonic() < deadline and not self.gone.is_set():
            await asyncio.sleep(TICK)
        self._kill()

    def _kill(self) -> None:
        """SIGKILL to the process's group, if it is alive; forget it."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        with self.host.lock:
            if self.host.processes.get((self.namespace, self.name)) is process:
                del self.host.processes[(self.namespace, self.name)]

    async def _delete(self) -> None:
        """What a kubelet does once the containers are gone: delete with grace 0, for this uid only."""
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        for _ in range(WRITE_ATTEMPTS):
            try:
                await self.host.client.request("DELETE", self.path, options)
                return
            except ApiError as error:
                if error.status in (404, 409):  # gone already, or a new pod of the same name
                    return
                log.warning("%s/%s: delete failed: %s", self.namespace, self.name, error)
            except API_ERRORS as error:
                log.warning("%s/%s: delete failed: %r", self.namespace, self.name, error)
            await asyncio.sleep(0.5)

    # -- status --------------------------------------------------------------------------------

    async def _write(self, phase: str, containers: list[Container]) -> None:
        """Patch the status subresource, only when something changed."""
        status = pod_status(
            self.pod, phase, self.ip, self.host.host_ip, self.start_time, containers, self.conditions
        )
        if status == self._written:
            return
        for _ in range(WRITE_ATTEMPTS):
            try:
                await self.host.client.request(
                    "PATCH", f"{self.path}/status", {"status": status}, content_type=MERGE_PATCH
                )
                self._written = status
                return
            except ApiError as error:
                if error.status == 404:
                    self.removed()
                    return
                log.warning("%s/%s: status write failed: %s", self.namespace, self.name, error)
            except API_ERRORS as error:
                log.warning("%s/%s: status write failed: %r", self.namespace, self.name, error)
            await asyncio.sleep(0.5)
