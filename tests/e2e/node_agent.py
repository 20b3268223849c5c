"""A stand-in kubelet for one node, talking to a real API server: it registers a Node with GPUs and
keeps its Lease fresh, and runs every pod bound to it, either as a stand-in that is Running and Ready
at once or, in the namespaces given to `run_processes_in`, as a real `kvasir serve` / `kvasir
operator` process on the pod's own loopback address. It runs in its own thread and event loop, so it
never blocks the tests' loop.

For simplicity it acts with the credentials it is given (the admin's); a real kubelet acts as
`system:node:<name>`, limited by the Node authorizer and the NodeRestriction admission plugin."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from tests.e2e.host import Host, pod_log_path
from tests.e2e.kube_client import MERGE_PATCH, ApiError, KubeClient
from tests.e2e.kubeconfig import Access
from tests.e2e.node_objects import LEASE_NAMESPACE, lease_manifest, node_manifest, node_status, now_micro
from tests.e2e.pod_worker import API_ERRORS, PodWorker

log = logging.getLogger("tests.e2e.node_agent")

NODE_NAME = "kvasir-e2e-node"
HOST_IP = "127.0.0.1"
LEASE_RENEW = 10.0  # seconds, as a kubelet: a quarter of the lease's 40 s
WATCH_SECONDS = 120  # each watch request's server-side timeout; the agent then watches again
RETRY = 1.0  # seconds before the pod watch or the lease is tried again after an error
UNSCHEDULABLE_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


class NodeAgent:
    """`start()` returns once the Node is registered and schedulable; `stop()` kills every process the
    agent started (always, whatever state it is in) and removes the Node."""

    def __init__(
        self,
        access: Access,
        log_dir: Path,
        node_name: str = NODE_NAME,
        gpus: int = 4,
        wait_schedulable: bool = True,
    ) -> None:
        self.access = access
        self.log_dir = log_dir
        self.node_name = node_name
        self.gpus = gpus
        # Without a controller-manager nothing removes the not-ready taint that admission adds.
        self.wait_schedulable = wait_schedulable
        self._process_namespaces: set[str] = set()
        self._processes: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._workers: dict[str, PodWorker] = {}

    # -- the tests' side (any thread) -----------------------------------------------------------

    def run_processes_in(self, namespace: str) -> None:
        """Run Kvasir pods created in `namespace` from now on as real processes."""
        with self._lock:
            self._process_namespaces.add(namespace)

    def log_path(self, namespace: str, pod: str) -> Path:
        """The file the pod's processes write stdout and stderr to (appended across restarts)."""
        return pod_log_path(self.log_dir, namespace, pod)

    def pod_process(self, namespace: str, name: str) -> subprocess.Popen[bytes] | None:
        """The pod's current process (possibly exited, awaiting its restart), or None."""
        with self._lock:
            return self._processes.get((namespace, name))

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the pod's process group, as when a container's main process is killed;
        LookupError if the pod has no live process."""
        process = self.pod_process(namespace, name)
        if process is None or process.poll() is not None:
            raise LookupError(f"pod {namespace}/{name} has no running process")
        os.killpg(process.pid, sig)

    def start(self, timeout: float = 60.0) -> None:
        """Register the node and start watching pods; raises what went wrong if not done in `timeout`."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(
            target=self._thread_main, name=f"node-agent-{self.node_name}", daemon=True
        )
        self._thread.start()
        try:
            self._ready.result(timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the agent; pods being deleted are not waited for. Idempotent."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("node agent thread did not stop within %ss", timeout)
        # Whatever happened in the agent's loop, no process outlives it.
        with self._lock:
            leftovers = list(self._processes.values())
            self._processes.clear()
        for process in leftovers:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)

    # -- the agent's thread -------------------------------------------------------------------

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as error:  # reported to start(); after it, only logged
            if not self._ready.done():
                self._ready.set_exception(error)
            else:
                log.exception("node agent failed")
        finally:
            loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        async with KubeClient(self.access) as client:
            host = Host(
                client,
                self.access,
                self.node_name,
                HOST_IP,
                self.log_dir,
                process_namespaces=self._process_namespaces,
                processes=self._processes,
                lock=self._lock,
            )
            tasks: list[asyncio.Task[None]] = []
            try:
                node = await self._register(client)
                tasks.append(asyncio.create_task(self._keep_lease(client, node)))
                tasks.append(asyncio.create_task(self._watch_pods(host)))
                if self.wait_schedulable:
                    await self._until_schedulable(client)
                self._ready.set_result(None)
                await self._stopping.wait()
            finally:
                workers = self._worker_tasks()
                for task in [*tasks, *workers]:
                    task.cancel()
                await asyncio.gather(*tasks, *workers, return_exceptions=True)
                with contextlib.suppress(*API_ERRORS):
                    # A Node left behind in a shared cluster would be tainted unreachable and keep pods.
                    await asyncio.wait_for(client.request("DELETE", f"/api/v1/nodes/{self.node_name}"), 10)

    # -- the node ------------------------------------------------------------------------------

    async def _register(self, client: KubeClient) -> dict[str, Any]:
        """Create the Node (with its status, as kubelets do); one left by an earlier run is refreshed."""
        version = (await client.request("GET", "/version"))["gitVersion"]
        manifest = node_manifest(self.node_name, self.gpus, HOST_IP, version)
        try:
            node: dict[str, Any] = await client.request("POST", "/api/v1/nodes", manifest)
        except ApiError as error:
            if error.status != 409:
                raise
            path = f"/api/v1/nodes/{self.node_name}"
            await client.request("PATCH", path, {"metadata": manifest["metadata"]}, content_type=MERGE_PATCH)
            status = {"status": node_status(self.gpus, HOST_IP, self.node_name, version)}
            node = await client.request("PATCH", f"{path}/status", status, content_type=MERGE_PATCH)
        log.info("registered node %s (%d GPUs)", self.node_name, self.gpus)
        return node

    async def _keep_lease(self, client: KubeClient, node: dict[str, Any]) -> None:
        """Renew the node's Lease: the heartbeat that keeps the node lifecycle controller from
        marking the node unreachable and tainting it."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.node_name}"
        while True:
            try:
                try:
                    renew = {"spec": {"holderIdentity": self.node_name, "renewTime": now_micro()}}
                    await client.request("PATCH", path, renew, content_type=MERGE_PATCH)
                except ApiError as error:
                    if error.status != 404:
                        raise
                    collection = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
                    await client.request("POST", collection, lease_manifest(node))
            except API_ERRORS as error:
                log.warning("lease renewal failed: %r", error)
                await asyncio.sleep(RETRY)
                continue
            await asyncio.sleep(LEASE_RENEW)

    async def _until_schedulable(self, client: KubeClient, timeout: float = 60.0) -> None:
        """Wait for the node lifecycle controller to lift the not-ready taint admission put on."""
        deadline = time.monotonic() + timeout
        taints: list[Any] = []
        while time.monotonic() < deadline:
            node = await client.request("GET", f"/api/v1/nodes/{self.node_name}")
            taints = [t for t in node["spec"].get("taints") or [] if t.get("key") in UNSCHEDULABLE_TAINTS]
            if not taints:
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"node {self.node_name} still tainted after {timeout:.0f}s: {taints}")

    # -- the pods ------------------------------------------------------------------------------

    def _worker_tasks(self) -> list[asyncio.Task[None]]:
        return [task for task in asyncio.all_tasks() if task.get_name().startswith("pod/")]

    async def _watch_pods(self, host: Host) -> None:
        """List and watch the pods bound to this node; relist when the watch's version expires."""
        path, selector = "/api/v1/pods", f"spec.nodeName={self.node_name}"
        version: str | None = None
        while True:
            try:
                if version is None:
                    listing = await host.client.request("GET", path, params={"fieldSelector": selector})
                    version = listing["metadata"]["resourceVersion"]
                    self._sync(host, listing["items"])
                params = {
                    "fieldSelector": selector,
                    "resourceVersion": str(version),
                    "allowWatchBookmarks": "true",
                    "timeoutSeconds": str(WATCH_SECONDS),
                }
                async for event in host.client.watch(path, params):
                    kind, pod = event["type"], event["object"]
                    if kind == "ERROR":
                        if pod.get("code") == 410:  # too old: start again from a fresh list
                            version = None
                            break
                        raise ApiError("WATCH", path, int(pod.get("code") or 500), str(pod))
                    version = pod["metadata"]["resourceVersion"]
                    if kind == "DELETED":
                        self._removed(pod["metadata"]["uid"])
                    elif kind != "BOOKMARK":
                        self._seen(host, pod)
            except ApiError as error:
                if error.status == 410:
                    version = None
                    continue
                log.warning("pod watch failed: %s", error)
                await asyncio.sleep(RETRY)
            except API_ERRORS as error:
                log.warning("pod watch failed: %r", error)
                await asyncio.sleep(RETRY)

    def _sync(self, host: Host, pods: list[dict[str, Any]]) -> None:
        """Bring the workers in line with a fresh list: pods missing from it were deleted meanwhile."""
        present = {pod["metadata"]["uid"] for pod in pods}
        for uid in list(self._workers):
            if uid not in present:
                self._removed(uid)
        for pod in pods:
            self._seen(host, pod)

    def _seen(self, host: Host, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self._workers.get(uid)
        if worker is not None:
            worker.update(pod)
            return
        worker = PodWorker(host, pod)
        self._workers[uid] = worker
        name = f"pod/{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        task = asyncio.create_task(worker.run(), name=name)
        task.add_done_callback(self._report)

    def _removed(self, uid: str) -> None:
        worker = self._workers.pop(uid, None)
        if worker is not None:
            worker.removed()

    @staticmethod
    def _report(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())
