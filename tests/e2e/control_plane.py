"""A real Kubernetes control plane for the end-to-end tests: an existing cluster (`KUBECONFIG`), or
etcd, kube-apiserver, kube-controller-manager and kube-scheduler started here from the binaries in
`KUBEBUILDER_ASSETS` (controller-runtime's envtest layout), on 127.0.0.1, with RBAC, the admission
plugins of a hardened cluster, TokenRequest and an audit log."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

import httpx

from tests.e2e import components
from tests.e2e.components import Component
from tests.e2e.kubeconfig import Access, read_access, write_token_kubeconfig
from tests.e2e.pki import make_client_cert, make_pki
from tests.e2e.polling import wait_for

ADMIN = "kvasir-e2e-admin"
SERVICE_CIDR = "10.0.0.0/24"
ISSUER = "https://kubernetes.default.svc.cluster.local"
START_TIMEOUT = 90.0  # seconds for each component; the API server's first start takes ~10 s on 2 cores

# Every request at Metadata level (who, what, verb, response code; no bodies): tests count 403s and
# the writes of a given user. RequestReceived is dropped: ResponseComplete carries all of it.
AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
"""


class KubectlError(subprocess.CalledProcessError):
    """kubectl failed; unlike CalledProcessError, the message includes what kubectl printed."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _kubectl_binary(assets: Path | None) -> str:
    if assets is not None and (assets / "kubectl").is_file():
        return str(assets / "kubectl")
    found = shutil.which("kubectl")
    if not found:
        raise FileNotFoundError("kubectl is neither in KUBEBUILDER_ASSETS nor on PATH")
    return found


def _validates(args: tuple[str, ...]) -> bool:
    """Whether kubectl would validate manifests (from files or stdin) against the server's OpenAPI."""
    files = any(
        arg in ("-f", "--filename", "-k", "--kustomize") or arg.startswith(("-f=", "--filename="))
        for arg in args
    )
    return (
        bool(args)
        and args[0] in ("apply", "create", "replace")
        and files
        and not any(arg.startswith("--validate") for arg in args)
    )


class ControlPlane:
    """Either an existing cluster (used as is; `audit_log` is None) or one this object started and
    `stop()` tears down. `kubeconfig` is an admin kubeconfig (system:masters) either way."""

    def __init__(self, kubeconfig: Path, kubectl_binary: str, audit_log: Path | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.access: Access = read_access(kubeconfig)
        self.server = self.access.server
        self.audit_log = audit_log
        # Started here without kube-controller-manager or kube-scheduler, nothing schedules or
        # reconciles; an existing cluster is assumed to have both.
        self.controllers = True
        self.directory: Path | None = None
        # Why the server's OpenAPI is unusable for client-side validation, if it is (see check_openapi).
        self.openapi_problem: str | None = None
        self._kubectl = kubectl_binary
        self._components: list[Component] = []

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_environment(cls) -> ControlPlane:
        """KUBEBUILDER_ASSETS wins over KUBECONFIG: asking for binaries is the more deliberate choice,
        and it keeps a developer's everyday KUBECONFIG from being used by accident."""
        assets = os.environ.get("KUBEBUILDER_ASSETS")
        if assets:
            return cls.start(Path(assets))
        kubeconfig = os.environ.get("KUBECONFIG")
        if kubeconfig:
            # kubectl merges a list of files; this suite uses the first, which must hold the context.
            plane = cls(Path(kubeconfig.split(os.pathsep)[0]), _kubectl_binary(None))
            plane.check_openapi()
            return plane
        raise RuntimeError("set KUBEBUILDER_ASSETS or KUBECONFIG")

    @classmethod
    def start(cls, assets: Path, node_address: str | None = None) -> ControlPlane:
        """Start etcd, kube-apiserver and, where the binaries exist, the controller-manager and the
        scheduler; returns once each is healthy and the controllers have made the default
        ServiceAccount. Raises ComponentError (with the component's log) if one does not start.
        With `node_address` (the host's address, for a real kubelet's pods) the API server also
        listens there and publishes it for the `kubernetes` Service, and reaches kubelets with a
        client certificate (`kubelet_client`)."""
        for required in ("etcd", "kube-apiserver"):
            if not (assets / required).is_file():
                raise FileNotFoundError(f"KUBEBUILDER_ASSETS={assets} has no {required}")
        directory = Path(tempfile.mkdtemp(prefix="kvasir-e2e-"))
        started: list[Component] = []
        try:
            plane = cls._start_in(assets, directory, started, node_address)
        except BaseException:
            for component in reversed(started):
                components.stop(component)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        atexit.register(plane.stop)  # a session that dies without its teardown still stops them
        plane.check_openapi()
        return plane

    @classmethod
    def _start_in(
        cls, assets: Path, directory: Path, started: list[Component], node_address: str | None = None
    ) -> ControlPlane:
        logs = directory / "logs"
        logs.mkdir()
        pki = make_pki(directory / "pki")
        if node_address is None:
            # Endpoints may not hold loopback addresses, so the default reconciler would fail to
            # publish 127.0.0.1 for the `kubernetes` Service every 10 s; nothing here runs in-cluster.
            network = [
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
            ]
        else:
            # Pods reach the API server through the `kubernetes` Service, which points at this address.
            kubelet_cert, kubelet_key = make_client_cert(
                pki,
                directory / "pki",
                "apiserver-kubelet-client",
                "kube-apiserver-kubelet-client",
                "system:masters",
            )
            network = [
                "--bind-address=0.0.0.0",
                f"--advertise-address={node_address}",
                f"--kubelet-client-certificate={kubelet_cert}",
                f"--kubelet-client-key={kubelet_key}",
                # `kubectl logs` dials the kubelet; the node's name is not in any DNS here.
                "--kubelet-preferred-address-types=InternalIP",
            ]
        tokens = {user: secrets.token_hex(16) for user in (ADMIN, "controller-manager", "scheduler")}
        token_file = directory / "tokens.csv"
        # token,user,uid,"groups": the controllers authenticate as the users default RBAC grants to.
        token_file.write_text(
            f'{tokens[ADMIN]},{ADMIN},{ADMIN},"system:masters"\n'
            f"{tokens['controller-manager']},system:kube-controller-manager,kube-controller-manager\n"
            f"{tokens['scheduler']},system:kube-scheduler,kube-scheduler\n"
        )
        audit_policy = directory / "audit-policy.yaml"
        audit_policy.write_text(AUDIT_POLICY)
        audit_log = directory / "audit.log"

        etcd_port, peer_port = _free_port(), _free_port()
        etcd = components.start(
            "etcd",
            [
                str(assets / "etcd"),
                f"--data-dir={directory / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            ],
            logs,
        )
        started.append(etcd)
        components.wait_healthy(etcd, f"http://127.0.0.1:{etcd_port}/health", START_TIMEOUT)

        port = _free_port()
        server = f"https://127.0.0.1:{port}"
        apiserver = components.start(
            "kube-apiserver",
            [
                str(assets / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                *network,
                f"--secure-port={port}",
                f"--tls-cert-file={pki.server_cert}",
                f"--tls-private-key-file={pki.server_key}",
                f"--client-ca-file={pki.ca_cert}",
                # The aggregation layer's front-proxy settings (kubeadm sets them too): without them the
                # controllers' delegated authentication logs an error every few seconds.
                f"--requestheader-client-ca-file={pki.ca_cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--token-auth-file={token_file}",
                "--authorization-mode=Node,RBAC",
                # In addition to the defaults: OwnerReferencesPermissionEnforcement makes
                # blockOwnerDeletion need update on the owner's finalizers (as on OpenShift).
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement,Priority",
                f"--service-account-issuer={ISSUER}",
                f"--service-account-key-file={pki.service_account_public_key}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                f"--audit-policy-file={audit_policy}",
                f"--audit-log-path={audit_log}",
                # blocking: each event is written before the request's handler returns, so a test
                # finds it as soon as it has its answer (give or take the final flush; poll).
                "--audit-log-mode=blocking",
                "--audit-log-maxsize=4096",  # MiB; lumberjack's default (100) would rotate mid-session
            ],
            logs,
        )
        started.append(apiserver)
        admin_headers = {"Authorization": f"Bearer {tokens[ADMIN]}"}
        ca = pki.ca_cert.read_bytes()
        access = Access(server, ca, False, tokens[ADMIN], None, None)
        components.wait_healthy(
            apiserver, f"{server}/readyz", START_TIMEOUT, access.ssl_context(), admin_headers
        )

        kubeconfigs = directory / "kubeconfigs"
        admin = write_token_kubeconfig(kubeconfigs / "admin.kubeconfig", access, tokens[ADMIN], ADMIN)
        plane = cls(admin, _kubectl_binary(assets), audit_log)
        plane.directory = directory
        plane._components = started

        binaries = {name: assets / name for name in ("kube-controller-manager", "kube-scheduler")}
        plane.controllers = all(binary.is_file() for binary in binaries.values())
        if not plane.controllers:
            return plane
        for name, user, extra in (
            (
                "kube-controller-manager",
                "controller-manager",
                [
                    # Each controller acts as its own ServiceAccount (kube-system/<controller>) with
                    # tokens from TokenRequest, exactly as RBAC's bootstrap policy expects.
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={pki.service_account_key}",
                    f"--root-ca-file={pki.ca_cert}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                ],
            ),
            ("kube-scheduler", "scheduler", []),
        ):
            own = write_token_kubeconfig(kubeconfigs / f"{user}.kubeconfig", access, tokens[user], user)
            health_port = _free_port()
            component = components.start(
                name,
                [
                    str(binaries[name]),
                    f"--kubeconfig={own}",
                    f"--authentication-kubeconfig={own}",
                    f"--authorization-kubeconfig={own}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={health_port}",
                    f"--cert-dir={directory / name}",
                    "--leader-elect=false",  # one replica; no Lease traffic in the audit log
                    *extra,
                ],
                logs,
            )
            started.append(component)
            components.wait_healthy(component, f"https://127.0.0.1:{health_port}/healthz", START_TIMEOUT)
        # The ServiceAccount controller makes default/default: proof the controllers act, and pods
        # created from here on are not refused for lack of it.
        with httpx.Client(verify=access.ssl_context(), headers=admin_headers, timeout=5) as client:
            url = f"{server}/api/v1/namespaces/default/serviceaccounts/default"
            wait_for(lambda: client.get(url).status_code == 200, "the default ServiceAccount", START_TIMEOUT)
        return plane

    def check_openapi(self) -> None:
        """Record (and warn) if the server cannot serve /openapi/v2 as protobuf, which kubectl's and
        helm's client-side validation download: then every `kubectl apply/create/replace -f` fails
        with "the server is currently unable to handle the request". Seen with kube-apiserver built
        by Go 1.27, whose JSON-v2-based encoding/json breaks kube-openapi's inline fields (the spec
        comes out with "Extensions"/"SchemaProps" keys that its protobuf conversion rejects)."""
        headers = {
            **self.access.headers(),
            "Accept": "application/com.github.proto-openapi.spec.v2@v1.0+protobuf",
        }
        with httpx.Client(verify=self.access.ssl_context(), headers=headers, timeout=60) as client:
            response = client.get(f"{self.server}/openapi/v2")
        if response.status_code != 200:
            self.openapi_problem = (
                f"GET /openapi/v2 (protobuf) answers HTTP {response.status_code}: kubectl runs with "
                "--validate=false (no client-side or strict server-side field validation); helm cannot "
                "install charts against this server"
            )
            warnings.warn(f"the API server's OpenAPI is broken: {self.openapi_problem}", stacklevel=2)

    # -- use ----------------------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 120,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl as the admin (or with `kubeconfig`); KubectlError on a non-zero exit if `check`.
        Where the server's OpenAPI is broken (`openapi_problem`), manifests are sent unvalidated."""
        if self.openapi_problem and _validates(args):
            args = (args[0], "--validate=false", *args[1:])
        command = [self._kubectl, f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        result = subprocess.run(
            command, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, command, result.stdout, result.stderr)
        return result

    def kubectl_json(self, *args: str, timeout: float = 120) -> Any:
        """`kubectl ... -o json`, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Wait until the CRD `crd` exists, is not being deleted and is Established. (`kubectl wait
        --for=condition=Established` right after an apply raced the CRD's first status, and a
        re-created CRD's predecessor still terminating.)"""

        def established() -> bool:
            found = self.kubectl("get", "crd", crd, "-o", "json", check=False)
            if found.returncode != 0:
                return False
            obj = json.loads(found.stdout)
            conditions = (obj.get("status") or {}).get("conditions") or []
            return not obj["metadata"].get("deletionTimestamp") and any(
                c.get("type") == "Established" and c.get("status") == "True" for c in conditions
            )

        wait_for(established, f"the CRD {crd} to be Established", timeout)

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """Write a kubeconfig for ServiceAccount `namespace/name` with a 24 h token from the TokenRequest
        API (what a pod's projected token holds); processes outside a pod authenticate with it."""
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=24h").stdout.strip()
        return write_token_kubeconfig(path, self.access, token, f"system:serviceaccount:{namespace}:{name}")

    def audit_events(self, user: str | None = None) -> list[dict[str, Any]]:
        """The audit log's ResponseComplete events so far, oldest first, only `user`'s if given."""
        if self.audit_log is None:
            raise RuntimeError("an existing cluster (KUBECONFIG) has no audit log this suite can read")
        events = []
        with self.audit_log.open() as lines:
            for line in lines:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the line the API server is writing right now
                if event.get("stage") != "ResponseComplete":
                    continue
                if user is None or (event.get("user") or {}).get("username") == user:
                    events.append(event)
        return events

    def component_logs(self) -> dict[str, Path]:
        """The log file of each component started here (empty for an existing cluster)."""
        return {component.name: component.log for component in self._components}

    def stop(self) -> None:
        """Stop what was started here, newest first, and remove its files; idempotent."""
        atexit.unregister(self.stop)
        for component in reversed(self._components):
            components.stop(component)
        self._components = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
