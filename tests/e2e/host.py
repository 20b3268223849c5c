"""What the pods of the node agent share: the API client, the node's address, loopback pod IPs,
the per-pod log files and the registry of running processes (read from the test's thread)."""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.kube_client import KubeClient
from tests.e2e.kubeconfig import Access


def pod_log_path(log_dir: Path, namespace: str, pod: str) -> Path:
    """Where the output of a pod's processes goes (appended across restarts)."""
    # Kubernetes names never hold "_", so the file name is unambiguous.
    return log_dir / f"{namespace}_{pod}.log"


@dataclass
class IpPool:
    """Unique loopback addresses 127.0.X.Y for pods (Linux routes all of 127/8 to lo), never
    127.0.0.1; X starts at 10 to stay clear of addresses other tests pick by hand."""

    _next: int = 0
    _taken: set[str] = field(default_factory=set)

    def take(self) -> str:
        for _ in range(245 * 254):
            self._next += 1
            index = self._next % (245 * 254)
            ip = f"127.0.{10 + index // 254}.{1 + index % 254}"
            if ip not in self._taken:
                self._taken.add(ip)
                return ip
        raise RuntimeError("no free loopback address for a pod")

    def give_back(self, ip: str) -> None:
        self._taken.discard(ip)


@dataclass
class Host:
    """The node's shared state; `processes` and `process_namespaces` are also used by the test thread."""

    client: KubeClient
    access: Access
    node_name: str
    host_ip: str
    log_dir: Path
    ips: IpPool = field(default_factory=IpPool)
    process_namespaces: set[str] = field(default_factory=set)
    processes: dict[tuple[str, str], subprocess.Popen[bytes]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def log_path(self, namespace: str, pod: str) -> Path:
        return pod_log_path(self.log_dir, namespace, pod)

    def credentials_path(self, namespace: str, pod: str) -> Path:
        return self.log_dir / "credentials" / f"{namespace}_{pod}.kubeconfig"
