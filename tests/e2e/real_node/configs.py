"""The configuration files of the real node, written from its directory layout: containerd's (own
root, state and socket, runc, no OOM-score raise, a locally made sandbox image), a CNI bridge, the
kubelet's KubeletConfiguration and kube-proxy's KubeProxyConfiguration. Each setting that this
machine needs and a stock node would not is commented with the refusal it avoids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

NODE_NAME = "kvasir-node"
POD_CIDR = "10.244.0.0/24"
BRIDGE = "kvasir-cni0"
SANDBOX_IMAGE = "localhost/kvasir-pause:e2e"
RUNC = "/usr/sbin/runc"
CNI_BIN = "/usr/lib/cni"


@dataclass(frozen=True)
class Layout:
    """Every path the node's daemons write to, under one directory (removed at teardown)."""

    root: Path

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.root / "containerd" / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet.yaml"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"

    @property
    def proxy_config(self) -> Path:
        return self.root / "kube-proxy.yaml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def containerd_toml(layout: Layout) -> str:
    socket = layout.containerd_socket
    return f"""\
version = 2
root = "{layout.root / "containerd" / "root"}"
state = "{layout.root / "containerd" / "state"}"

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.grpc.v1.cri"]
  # Built here (no registry is reachable): catatonit in pause mode.
  sandbox_image = "{SANDBOX_IMAGE}"
  # Without CAP_SYS_RESOURCE a container's oom_score_adj may not go below the daemon's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # crun refuses the host's mixed cgroup v1 layout; runc accepts it.
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{layout.cni_conf_dir}"
"""


def cni_conflist(layout: Layout) -> str:
    """One bridge, host-local addresses from POD_CIDR, masquerade outwards, hairpin so that a pod
    reaches itself through its Service. No portmap: nothing here uses hostPort."""
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "kvasir-e2e",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(layout.root / "cni" / "ipam"),
                    },
                }
            ],
        },
        indent=1,
    )


def kubelet_yaml(layout: Layout, node_address: str, client_ca: Path) -> str:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # The host mounts cgroup v1; kubelet 1.35+ refuses to start on it unless told.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",  # no systemd as PID 1
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "address": node_address,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        # The API server (kubectl logs) presents a client certificate of the test CA.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "Webhook"},
        "failSwapOn": False,
        "podLogsDir": str(layout.pod_logs),
        # A shared machine's disk and memory use say nothing about this node: never evict, never
        # collect the imported images (there is no registry to pull them back from).
        "evictionHard": {},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "localStorageCapacityIsolation": False,
        "serializeImagePulls": False,
        "resolvConf": "/etc/resolv.conf",
    }
    return yaml.safe_dump(config, sort_keys=False)


def kube_proxy_yaml(kubeconfig: Path, node_address: str) -> str:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_CIDR,
        "bindAddress": "127.0.0.1",
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{node_address}/32"],
        # Leave the host's conntrack sysctls alone (no permission to raise them in a container).
        "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }
    return yaml.safe_dump(config, sort_keys=False)


def write_all(layout: Layout, node_address: str, client_ca: Path, proxy_kubeconfig: Path) -> None:
    for directory in (layout.cni_conf_dir, layout.kubelet_root, layout.pod_logs, layout.logs):
        directory.mkdir(parents=True, exist_ok=True)
    layout.containerd_config.write_text(containerd_toml(layout))
    (layout.cni_conf_dir / "10-kvasir.conflist").write_text(cni_conflist(layout))
    layout.kubelet_config.write_text(kubelet_yaml(layout, node_address, client_ca))
    layout.proxy_config.write_text(kube_proxy_yaml(proxy_kubeconfig, node_address))
