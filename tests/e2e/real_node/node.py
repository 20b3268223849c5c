"""A real Kubernetes node beside the suite's control plane: containerd (runc, a CNI bridge), the
kubelet and kube-proxy (iptables mode), started as root from KUBEBUILDER_ASSETS; the images put
into containerd; `start()` returns once the Node is Ready. `stop()` deletes what the node ran and
undoes what it changed on the host (containers, network namespaces, the bridge, iptables chains,
cgroups, mounts), whatever state the start reached."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.e2e import components
from tests.e2e.components import Component
from tests.e2e.control_plane import ControlPlane
from tests.e2e.kubeconfig import Access
from tests.e2e.pki import Pki, make_client_cert
from tests.e2e.polling import wait_for
from tests.e2e.real_node import configs, images
from tests.e2e.real_node.configs import BRIDGE, NODE_NAME, SANDBOX_IMAGE, Layout

START_TIMEOUT = 120.0  # seconds for each daemon; the kubelet's first sync takes a few on 2 cores
DRAIN_TIMEOUT = 240.0  # seconds for the kubelet to stop every pod before it is stopped itself
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Fixed paths outside the node's directory: the kubelet's device-plugin socket and container log
# links, containerd's network namespaces and CNI result cache. Removed at the end if the node made them.
HOST_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/containers"),
    Path("/var/log/pods"),
    Path("/run/netns"),
    Path("/var/lib/cni"),
)


def host_address() -> str:
    """The host's address on its default route: the Node's InternalIP and the API server's
    advertised address (a pod reaches both; loopback is refused for either)."""
    route = subprocess.run(
        ["ip", "-4", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True, timeout=10
    )
    found = re.search(r"\bsrc (\S+)", route.stdout)
    if route.returncode != 0 or not found:
        raise RuntimeError(f"no default route to take the node's address from: {route.stderr.strip()}")
    return found.group(1)


def missing_requirements(assets: Path) -> list[str]:
    """What this machine lacks for a real node (empty: it can try)."""
    missing = [
        f"{name} in KUBEBUILDER_ASSETS" for name in ("kubelet", "kube-proxy") if not (assets / name).is_file()
    ]
    if os.geteuid() != 0:
        missing.append("root (the kubelet, containerd and kube-proxy need it)")
    for tool in ("containerd", "ctr", "podman", "iptables", "ip"):
        if shutil.which(tool) is None:
            missing.append(f"{tool} on PATH")
    for path in (Path(configs.RUNC), Path(configs.CNI_BIN) / "bridge", images.CATATONIT):
        if not path.exists():
            missing.append(str(path))
    return missing


def _kubeconfig(path: Path, access: Access, cert: Path, key: Path, ca: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "e2e", "cluster": {"server": access.server, "certificate-authority": str(ca)}}
                ],
                "users": [
                    {"name": "node", "user": {"client-certificate": str(cert), "client-key": str(key)}}
                ],
                "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "node"}}],
                "current-context": "e2e",
            }
        )
    )
    return path


IPTABLES = ("iptables", "ip6tables")  # kube-proxy and the kubelet write both families


def _iptables_rules() -> dict[tuple[str, str], set[str]]:
    """Every rule and chain (`iptables -S` lines) by (command, table)."""
    rules: dict[tuple[str, str], set[str]] = {}
    for command in IPTABLES:
        for table in ("filter", "nat", "mangle"):
            listed = subprocess.run([command, "-t", table, "-S"], capture_output=True, text=True, timeout=30)
            rules[command, table] = set(listed.stdout.splitlines())
    return rules


def _ours(rule: str) -> bool:
    """A rule or chain kube-proxy, the kubelet or the bridge plugin made (never podman's)."""
    return bool(re.search(r"\b(KUBE-|CNI-)", rule))


class RealNode:
    def __init__(
        self, plane: ControlPlane, assets: Path, kvasir_images: Sequence[str] = images.KVASIR_IMAGES
    ) -> None:
        if plane.directory is None:
            raise RuntimeError(
                "a real node needs the control plane this suite started (its CA signs the node)"
            )
        self.plane = plane
        self.assets = assets
        self.kvasir_images = tuple(kvasir_images)
        self.address = host_address()
        self.layout = Layout(Path(tempfile.mkdtemp(prefix="kvasir-node-")))
        self.import_seconds: dict[str, float] = {}
        self._components: list[Component] = []
        self._netns_before: set[str] = set()
        self._rules_before: dict[tuple[str, str], set[str]] = {}
        self._host_paths_before = {path for path in HOST_PATHS if path.exists()}

    # -- start --------------------------------------------------------------------------------

    def start(self) -> None:
        """containerd, the images, the kubelet, kube-proxy; returns once the Node is Ready.
        ComponentError (with the daemon's log) when one refuses to run."""
        self._netns_before = set(_netns())
        self._rules_before = _iptables_rules()
        directory = self.plane.directory
        assert directory is not None  # checked in __init__
        pki_dir = directory / "pki"
        pki = Pki(
            pki_dir / "ca.crt", pki_dir / "ca.key", pki_dir / "apiserver.crt",
            pki_dir / "apiserver.key", pki_dir / "sa.key", pki_dir / "sa.pub",
        )  # fmt: skip
        certs = self.layout.root / "certs"
        # The Node authorizer and NodeRestriction know a kubelet by this name and group.
        kubelet_cert = make_client_cert(pki, certs, "kubelet", f"system:node:{NODE_NAME}", "system:nodes")
        # RBAC's system:node-proxier is bound to this user.
        proxy_cert = make_client_cert(pki, certs, "kube-proxy", "system:kube-proxy")
        kubelet_kubeconfig = _kubeconfig(
            certs / "kubelet.kubeconfig", self.plane.access, *kubelet_cert, pki.ca_cert
        )
        proxy_kubeconfig = _kubeconfig(
            certs / "kube-proxy.kubeconfig", self.plane.access, *proxy_cert, pki.ca_cert
        )
        configs.write_all(self.layout, self.address, pki.ca_cert, proxy_kubeconfig)
        logs = self.layout.logs

        containerd = components.start(
            "containerd", ["containerd", "--config", str(self.layout.containerd_config)], logs
        )
        self._components.append(containerd)
        wait_for(
            lambda: containerd.process.poll() is not None or self._ctr_answers(),
            "containerd to answer on its socket",
            START_TIMEOUT,
        )
        if containerd.process.poll() is not None:
            raise containerd.failure("exited while starting")
        images.import_pause(self.layout.containerd_socket, SANDBOX_IMAGE)
        self.import_seconds = images.import_from_podman(self.layout.containerd_socket, self.kvasir_images)

        kubelet = components.start(
            "kubelet",
            [
                str(self.assets / "kubelet"),
                f"--config={self.layout.kubelet_config}",
                f"--kubeconfig={kubelet_kubeconfig}",
                f"--root-dir={self.layout.kubelet_root}",
                f"--cert-dir={self.layout.root / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={self.address}",
                "--v=2",
            ],
            logs,
        )
        self._components.append(kubelet)
        components.wait_healthy(kubelet, "http://127.0.0.1:10248/healthz", START_TIMEOUT)
        proxy = components.start(
            "kube-proxy",
            [str(self.assets / "kube-proxy"), f"--config={self.layout.proxy_config}", "--v=2"],
            logs,
        )
        self._components.append(proxy)
        components.wait_healthy(proxy, "http://127.0.0.1:10256/healthz", START_TIMEOUT)
        self._wait_node_ready(kubelet)

    def _ctr_answers(self) -> bool:
        answer = subprocess.run(
            [*images.ctr_command(self.layout.containerd_socket), "version"], capture_output=True, timeout=30
        )
        return answer.returncode == 0

    def _wait_node_ready(self, kubelet: Component) -> None:
        url = f"{self.plane.server}/api/v1/nodes/{NODE_NAME}"
        with httpx.Client(
            verify=self.plane.access.ssl_context(), headers=self.plane.access.headers()
        ) as client:

            def ready() -> bool:
                if kubelet.process.poll() is not None:
                    raise kubelet.failure("exited before its Node was Ready")
                answer = client.get(url)
                if answer.status_code != 200:
                    return False
                conditions = answer.json().get("status", {}).get("conditions") or []
                return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

            wait_for(ready, f"Node {NODE_NAME} to be Ready", START_TIMEOUT, interval=0.5)

    def logs(self) -> dict[str, Path]:
        return {component.name: component.log for component in self._components}

    def pod_log_files(self, namespace: str, pod: str) -> list[Path]:
        """The kubelet's log files of a pod's containers (every restart), oldest first."""
        return sorted(self.layout.pod_logs.glob(f"{namespace}_{pod}_*/*/*.log"))

    # -- stop ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the daemons and undo the host changes; idempotent, and safe after a failed start."""
        kubelet = next((c for c in self._components if c.name == "kubelet"), None)
        if kubelet is not None and kubelet.process.poll() is None:
            self._drain()
        for component in reversed(self._components):
            components.stop(component)
        self._components = []
        self._remove_leftovers()

    def _drain(self) -> None:
        """Delete every pod bound to the node, at once, and wait until the kubelet has stopped them
        (sandboxes torn down through CNI, volumes unmounted)."""
        selector = f"spec.nodeName={NODE_NAME}"
        self.plane.kubectl(
            "delete", "pods", "--all-namespaces", "--field-selector", selector, "--grace-period=0",
            "--force", "--wait=false", check=False,
        )  # fmt: skip
        with contextlib.suppress(TimeoutError):
            wait_for(
                lambda: (
                    not self.plane.kubectl(
                        "get", "pods", "-A", "--field-selector", selector, "-o", "name", check=False
                    ).stdout.strip()
                    and not self._sandboxes()
                ),
                "the node's pods to stop",
                DRAIN_TIMEOUT,
                interval=1.0,
            )

    def _sandboxes(self) -> list[str]:
        listed = subprocess.run(
            [*images.ctr_command(self.layout.containerd_socket), "tasks", "list", "--quiet"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return listed.stdout.split() if listed.returncode == 0 else []

    def _remove_leftovers(self) -> None:
        # Containers a dead kubelet left running: their shims outlive containerd, so kill them by id.
        if self.layout.containerd_socket.exists():
            self._kill_tasks()
        for namespace in set(_netns()) - self._netns_before:
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, timeout=30)
        self._remove_iptables()
        _remove_cgroups()
        _unmount_under(self.layout.root)
        self._remove_host_paths()
        shutil.rmtree(self.layout.root, ignore_errors=True)

    def _remove_host_paths(self) -> None:
        """Log links into this node's directory, and the fixed paths that did not exist before."""
        links = HOST_PATHS[1]
        for link in links.glob("*.log") if links.is_dir() else ():
            if link.is_symlink() and os.readlink(link).startswith(f"{self.layout.root}/"):
                link.unlink()
        for path in HOST_PATHS:
            if path not in self._host_paths_before:
                if path.is_mount():  # /run/netns: mounted over itself for the namespaces' bind mounts
                    subprocess.run(["umount", str(path)], capture_output=True, timeout=30)
                shutil.rmtree(path, ignore_errors=True)

    def _kill_tasks(self) -> None:
        socket = self.layout.containerd_socket
        containerd = subprocess.Popen(
            ["containerd", "--config", str(self.layout.containerd_config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            with contextlib.suppress(TimeoutError):
                wait_for(self._ctr_answers, "containerd (to remove leftover containers)", 60)
            ctr = images.ctr_command(socket)
            for task in self._sandboxes():
                subprocess.run(
                    [*ctr, "tasks", "kill", "--signal", "SIGKILL", task], capture_output=True, timeout=30
                )
                subprocess.run([*ctr, "tasks", "delete", "--force", task], capture_output=True, timeout=60)
        finally:
            containerd.terminate()
            containerd.wait(timeout=60)

    def _remove_iptables(self) -> None:
        """Delete the rules and chains that appeared while the node ran and are kube-proxy's, the
        kubelet's or the bridge plugin's (KUBE-*, CNI-*); podman's and anyone else's stay."""
        remove_rules(_iptables_rules(), self._rules_before)


def remove_rules(now: dict[tuple[str, str], set[str]], before: dict[tuple[str, str], set[str]]) -> None:
    """Delete the KUBE-* and CNI-* rules and chains in `now` that are not in `before`."""
    for (command, table), rules in now.items():
        added = [rule for rule in rules - before.get((command, table), set()) if _ours(rule)]
        chains = [rule[3:].strip() for rule in added if rule.startswith("-N ")]
        # Jumps into our chains from chains that stay (PREROUTING, FORWARD, ...) go first; a chain
        # of ours is emptied whole, then removed.
        for words in (shlex.split(rule)[1:] for rule in added if rule.startswith("-A ")):
            if words[0] not in chains:
                subprocess.run([command, "-t", table, "-D", *words], capture_output=True, timeout=30)
        for flag in ("-F", "-X"):
            for chain in chains:
                subprocess.run([command, "-t", table, flag, chain], capture_output=True, timeout=30)


def _netns() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _remove_cgroups() -> None:
    """The kubelet's `kubepods` hierarchy in every v1 controller, deepest first (empty once the
    containers are gone)."""
    for controller in CGROUP_ROOT.iterdir():
        top = controller / "kubepods"
        if not top.is_dir():
            continue
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _unmount_under(root: Path) -> None:
    """Lazily unmount whatever is still mounted below `root` (volumes of a pod whose kubelet died),
    deepest first, so that the directory can be removed."""
    mounts = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            point = line.split()[4].replace("\\040", " ")
            if point == str(root) or point.startswith(f"{root}/"):
                mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)
