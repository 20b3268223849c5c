"""The operator as a user meets it, on a real control plane: installed by its Helm chart and run
under the chart's ServiceAccount, it turns every sample LLMDeployment into children that the real
controllers, scheduler, admission plugins and garbage collector act on, and reports what they say
(scheduling failures, a missing Secret or PriorityClass, a Service that is not its own) in status
and Events. `kubectl scale`, removed fields, idleness and RBAC are checked against the audit log."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.control_plane import ControlPlane
from tests.e2e.kvasir_release import (
    CRD_FILE,
    CRD_NAME,
    WRITES,
    Release,
    condition,
    events,
    status_where,
)
from tests.e2e.polling import wait_for
from tests.invalid_specs import INVALID, merge

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "crds" / "samples"
GC = "system:serviceaccount:kube-system:generic-garbage-collector"
CHILDREN = ("deployment", "service", "poddisruptionbudget")
SETTLE = 90.0  # seconds for a status to follow the cluster on a loaded 2-core machine

pytestmark = pytest.mark.slow


def _sample(name: str, namespace: str) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())
    manifest["metadata"]["namespace"] = namespace  # full.yaml names its own
    return manifest


def _apply(control_plane: ControlPlane, manifest: dict[str, Any]) -> None:
    control_plane.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))


def _status_where(
    control_plane: ControlPlane, release: Release, namespace: str, name: str, what: str, check: Any
) -> dict[str, Any]:
    return status_where(control_plane, release, namespace, name, what, check, SETTLE)


def _degraded_with(reason: str, text: str) -> Any:
    def check(obj: dict[str, Any]) -> bool:
        degraded = condition(obj, "Degraded")
        return (
            degraded.get("status") == "True"
            and degraded.get("reason") == reason
            and text in degraded.get("message", "")
        )

    return check


def _running(obj: dict[str, Any]) -> bool:
    status = obj.get("status") or {}
    return status.get("phase") == "Running" and condition(obj, "Available").get("status") == "True"


# -- install ---------------------------------------------------------------------------------------


def test_chart_installs_crd_and_two_operators_one_leading(
    control_plane: ControlPlane, release: Release
) -> None:
    crd = control_plane.kubectl_json("get", "crd", CRD_NAME)
    assert condition(crd, "Established")["status"] == "True"
    assert condition(crd, "NamesAccepted")["status"] == "True"
    stored = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    shipped = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert stored == shipped  # the server kept every rule and default as written
    pods = release.pods()
    assert len(pods) == 2
    assert all(condition(pod, "Ready")["status"] == "True" for pod in pods)
    assert release.leader() in {pod["metadata"]["name"] for pod in pods}


def test_crd_applies_with_kubectl_validation_and_server_side(
    control_plane: ControlPlane, release: Release
) -> None:
    """The CRD is also installable (and upgradable) with kubectl, client-side validated or applied
    server-side, which is how docs/operator.md tells users to upgrade it (Helm never does)."""
    control_plane.kubectl("apply", "--dry-run=server", "-f", str(CRD_FILE))
    applied = control_plane.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=kvasir-e2e", "-f", str(CRD_FILE)
    )
    assert "serverside-applied" in applied.stdout


def test_plain_manifests_move_from_client_side_to_server_side_apply(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """deploy/kvasir.yaml's operator Deployment applied with `kubectl apply`, then with `kubectl
    apply --server-side` (the documented way to upgrade) without --force-conflicts: no conflict.
    A field the server defaults and the manifest left out (`fieldRef.apiVersion`) made one."""
    documents = yaml.safe_load_all((REPO / "deploy" / "kvasir.yaml").read_text())
    deployment = next(d for d in documents if d and d["kind"] == "Deployment")
    deployment["metadata"]["namespace"] = namespace
    deployment["spec"]["replicas"] = 0  # its objects, not its pods, are what is applied
    manifest = json.dumps(deployment)
    control_plane.kubectl("apply", "-f", "-", stdin=manifest)
    upgraded = control_plane.kubectl("apply", "--server-side", "-f", "-", stdin=manifest, check=False)
    assert upgraded.returncode == 0, upgraded.stderr


# -- the samples -----------------------------------------------------------------------------------


def test_minimal_sample_runs_with_owned_children_and_printer_columns(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    _apply(control_plane, _sample("minimal", namespace))
    obj = _status_where(control_plane, release, namespace, "smollm2", "Running", _running)
    status = obj["status"]
    assert status["endpoint"] == f"http://smollm2.{namespace}.svc:8000"
    assert status["readyReplicas"] == 1 and status["observedGeneration"] == obj["metadata"]["generation"]
    for kind in CHILDREN:
        child = control_plane.kubectl_json("get", kind, "smollm2", "-n", namespace)
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "LLMDeployment",
            "smollm2",
            obj["metadata"]["uid"],
        )
        assert owner["controller"] is True
    table = control_plane.kubectl("get", "llmd", "smollm2", "-n", namespace, "-o", "wide").stdout
    header, row = table.splitlines()
    assert header.split()[:4] == ["NAME", "MODEL", "READY", "DESIRED"]
    assert row.split()[:4] == ["smollm2", "hf://HuggingFaceTB/SmolLM2-135M-Instruct", "1", "1"]
    assert "Running" in row


def test_missing_token_secret_is_reported_then_recovers(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """The operator reads the Secret before it makes pods that would wait for it; creating the
    Secret is enough (retried 2 s doubling to 30 s)."""
    _apply(control_plane, _sample("autoscaling", namespace))
    check = _degraded_with(
        "SecretNotFound", f"Secret {namespace}/hf-token (spec.model.tokenSecretRef) not found"
    )
    _status_where(control_plane, release, namespace, "llama-3-8b", "the missing Secret in status", check)
    wait_for(
        lambda: any(e["reason"] == "SecretNotFound" for e in events(control_plane, namespace, "llama-3-8b")),
        "the Warning Event",
    )
    control_plane.kubectl(
        "create", "secret", "generic", "hf-token", "--from-literal=token=hf_x", "-n", namespace
    )
    _status_where(control_plane, release, namespace, "llama-3-8b", "Running once the Secret exists", _running)


def test_secret_deleted_under_running_pods_is_a_container_config_error(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """A Secret deleted after the pods were made: the next pod (here, after a scale-up) cannot
    start, and the kubelet's CreateContainerConfigError reaches status."""
    control_plane.kubectl(
        "create", "secret", "generic", "hf-token", "--from-literal=token=hf_x", "-n", namespace
    )
    manifest = _sample("autoscaling", namespace)
    del manifest["spec"]["autoscaling"]
    _apply(control_plane, manifest)
    _status_where(control_plane, release, namespace, "llama-3-8b", "Running", _running)
    control_plane.kubectl("delete", "secret", "hf-token", "-n", namespace)
    control_plane.kubectl("scale", "llmd/llama-3-8b", "--replicas=2", "-n", namespace)
    _status_where(
        control_plane, release, namespace, "llama-3-8b", "CreateContainerConfigError or SecretNotFound",
        lambda o: condition(o, "Degraded").get("reason") in ("CreateContainerConfigError", "SecretNotFound"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("sample", "name", "claim"),
    [("pvc-model", "qwen-pvc", "model-store"), ("shared-cache", "qwen3-shared-cache", "hf-cache")],
)
def test_missing_claim_is_unschedulable(
    control_plane: ControlPlane, release: Release, namespace: str, sample: str, name: str, claim: str
) -> None:
    _apply(control_plane, _sample(sample, namespace))
    obj = _status_where(
        control_plane, release, namespace, name, "Unschedulable in status",
        _degraded_with("Unschedulable", f'persistentvolumeclaim "{claim}" not found'),
    )  # fmt: skip
    assert obj["status"]["phase"] == "Degraded"
    wait_for(
        lambda: any(
            e["reason"] == "Unschedulable" and e["type"] == "Warning"
            for e in events(control_plane, namespace, name)
        ),
        "the Unschedulable Event",
    )


def test_full_sample_reports_missing_secrets_then_what_admission_refuses(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """full.yaml names two Secrets, a RuntimeClass and a PriorityClass this cluster lacks. The
    operator reports the Secrets itself; once they exist, admission refuses the pods, the
    ReplicaSet cannot create them, and the LLMDeployment says why."""
    _apply(control_plane, _sample("full", namespace))
    _status_where(
        control_plane, release, namespace, "mistral-7b", "SecretNotFound",
        _degraded_with("SecretNotFound", f"Secret {namespace}/"),
    )  # fmt: skip
    for secret, key in (("hf-token", "token"), ("mistral-api-key", "api-key")):
        control_plane.kubectl(
            "create", "secret", "generic", secret, f"--from-literal={key}=x", "-n", namespace
        )

    def refused(obj: dict[str, Any]) -> bool:
        degraded = condition(obj, "Degraded")
        message = degraded.get("message", "")
        return degraded.get("status") == "True" and (
            'RuntimeClass "nvidia"' in message or "no PriorityClass with name inference-high" in message
        )

    obj = _status_where(control_plane, release, namespace, "mistral-7b", "the admission refusal", refused)
    assert condition(obj, "Degraded")["reason"] == "FailedCreate"
    assert obj["status"]["phase"] == "Degraded"


# -- changes ----------------------------------------------------------------------------------------


def test_kubectl_scale_and_a_replica_that_cannot_be_placed(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    _apply(control_plane, _sample("minimal", namespace))
    _status_where(control_plane, release, namespace, "smollm2", "Running", _running)
    # The node has 4 GPUs and each replica takes one: the fifth cannot be placed.
    control_plane.kubectl("scale", "llmd/smollm2", "--replicas=5", "-n", namespace)
    wait_for(
        lambda: (
            control_plane.kubectl_json("get", "deployment", "smollm2", "-n", namespace)["spec"]["replicas"]
            == 5
        ),
        "the Deployment to follow the scale subresource",
    )
    _status_where(
        control_plane, release, namespace, "smollm2", "Unschedulable",
        _degraded_with("Unschedulable", "Insufficient nvidia.com/gpu"),
    )  # fmt: skip
    scale = json.loads(
        control_plane.kubectl(
            "get",
            "--raw",
            f"/apis/inference.kvasir.dev/v1alpha1/namespaces/{namespace}/llmdeployments/smollm2/scale",
        ).stdout
    )
    assert scale["spec"]["replicas"] == 5
    assert scale["status"]["selector"] == "app.kubernetes.io/instance=smollm2,app.kubernetes.io/name=kvasir"
    control_plane.kubectl("scale", "llmd/smollm2", "--replicas=2", "-n", namespace)
    obj = _status_where(
        control_plane, release, namespace, "smollm2", "2 ready replicas",
        lambda o: _running(o) and (o.get("status") or {}).get("readyReplicas") == 2
        and condition(o, "Degraded").get("status") == "False",
    )  # fmt: skip
    assert obj["spec"]["replicas"] == 2


def test_removed_fields_leave_the_deployment(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    manifest = merge(
        _sample("minimal", namespace),
        {
            "spec": {
                "runtime": {"maxNumSeqs": 64},
                "scheduling": {"nodeSelector": {"kubernetes.io/os": "linux"}},
            }
        },
    )
    _apply(control_plane, manifest)

    def pod_spec() -> dict[str, Any]:
        deployment = control_plane.kubectl_json("get", "deployment", "smollm2", "-n", namespace)
        spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
        return spec

    wait_for(
        lambda: (
            control_plane.kubectl("get", "deployment", "smollm2", "-n", namespace, check=False).returncode
            == 0
        ),
        "the Deployment",
    )

    def max_num_seqs() -> str:
        args: list[str] = pod_spec()["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1]

    assert max_num_seqs() == "64"
    assert pod_spec()["nodeSelector"] == {"kubernetes.io/os": "linux"}

    _apply(control_plane, _sample("minimal", namespace))  # both fields removed
    wait_for(lambda: max_num_seqs() == "256", "--max-num-seqs back to its default")
    wait_for(lambda: not pod_spec().get("nodeSelector"), "the nodeSelector to go")
    _status_where(control_plane, release, namespace, "smollm2", "Running on the new template", _running)


def test_service_of_the_same_name_owned_by_someone_else(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "smollm2", "namespace": namespace, "labels": {"team": "web"}},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }
    _apply(control_plane, service)
    _apply(control_plane, _sample("minimal", namespace))
    obj = _status_where(
        control_plane, release, namespace, "smollm2", "ServiceNotOwned",
        lambda o: condition(o, "Available").get("reason") == "ServiceNotOwned",
    )  # fmt: skip
    assert not obj["status"].get("endpoint")
    theirs = control_plane.kubectl_json("get", "service", "smollm2", "-n", namespace)
    assert theirs["spec"]["selector"] == {"app": "web"}  # left alone
    assert not theirs["metadata"].get("ownerReferences")
    touched = [
        e for e in release.operator_requests()
        if e["verb"] in WRITES and (e.get("objectRef") or {}).get("resource") == "services"
        and e["objectRef"].get("namespace") == namespace
    ]  # fmt: skip
    assert touched == []


# -- steady state and deletion ------------------------------------------------------------------


def _operator_writes(release: Release, namespace: str) -> list[tuple[str, str, str, str]]:
    """The operator's writes in `namespace`, from the audit log: (time, verb, resource, name)."""
    return [
        (
            e["requestReceivedTimestamp"],
            e["verb"],
            "/".join(filter(None, (e["objectRef"].get("resource"), e["objectRef"].get("subresource")))),
            e["objectRef"].get("name", ""),
        )
        for e in release.operator_requests()
        if e["verb"] in WRITES and (e.get("objectRef") or {}).get("namespace") == namespace
    ]


def _settled(writes: Any) -> tuple[int] | None:
    """(the count of `writes()`) when no write came in 5 s, else None: a probe for wait_for."""
    count = len(writes())
    time.sleep(5)
    return (count,) if len(writes()) == count else None


def test_idle_operator_writes_nothing(control_plane: ControlPlane, release: Release, namespace: str) -> None:
    """Once converged (no write for 5 s after Running: the rollout's last status changes are
    reported), 20 s pass without a single write of the operator in the namespace."""
    _apply(control_plane, _sample("minimal", namespace))
    _status_where(control_plane, release, namespace, "smollm2", "Running", _running)

    def writes() -> list[tuple[str, str, str, str]]:
        return _operator_writes(release, namespace)

    def settled() -> tuple[int] | None:
        return _settled(writes)

    (before,) = wait_for(settled, "the operator to stop writing after convergence", SETTLE, interval=0)
    time.sleep(20)
    assert writes()[before:] == [], f"writes while idle, after these: {writes()[:before]}"


def test_objects_that_wait_get_no_writes_even_across_a_failover(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """A missing Secret, a missing claim (pods Unschedulable) and an invalid spec: once each status
    says what it waits for, the operator writes nothing in the namespace (audit log), before and
    after the leader's pod is deleted and the standby takes over. The window covers the in-memory
    retries' 2 s doubling to their 30 s cap; KVASIR_E2E_IDLE_SECONDS lengthens it (600: the ten
    minutes docs/operator.md reports)."""
    _apply(control_plane, _sample("autoscaling", namespace))
    _apply(control_plane, _sample("pvc-model", namespace))
    invalid = _sample("minimal", namespace)
    invalid["metadata"]["name"] = "invalid"
    invalid["spec"]["model"] = {"source": "hf://org/na me"}
    _apply(control_plane, invalid)
    waiting = {
        "llama-3-8b": _degraded_with("SecretNotFound", "not found"),
        "qwen-pvc": _degraded_with("Unschedulable", "model-store"),
        "invalid": _degraded_with("InvalidSpec", "na me"),
    }
    names = {
        obj["metadata"]["name"]: obj
        for obj in control_plane.kubectl_json("get", "llmd", "-n", namespace)["items"]
    }
    for name, check in waiting.items():
        assert name in names, sorted(names)
        _status_where(control_plane, release, namespace, name, "what it waits for", check)
    window = float(os.environ.get("KVASIR_E2E_IDLE_SECONDS", "75"))

    def writes() -> list[tuple[str, str, str, str]]:
        return _operator_writes(release, namespace)

    def settled() -> tuple[int] | None:
        return _settled(writes)

    for phase in ("first leader", "after the failover"):
        (before,) = wait_for(settled, f"the operator to stop writing ({phase})", SETTLE, interval=0)
        time.sleep(window)
        assert writes()[before:] == [], f"{phase}: writes while waiting, after these: {writes()[:before]}"
        if phase == "first leader":
            leader = release.leader()
            control_plane.kubectl("delete", "pod", leader, "-n", "kvasir-system", "--wait=false")
            release.leader(timeout=SETTLE, other_than=leader)


def test_deleting_an_llmdeployment_leaves_its_children_to_the_garbage_collector(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    _apply(control_plane, _sample("minimal", namespace))
    _status_where(control_plane, release, namespace, "smollm2", "Running", _running)
    control_plane.kubectl("delete", "llmd", "smollm2", "-n", namespace, "--timeout=60s")
    wait_for(
        lambda: (
            not control_plane.kubectl(
                "get", "deployments,services,poddisruptionbudgets", "-n", namespace, "-o", "name"
            ).stdout.strip()
        ),
        "the children to be collected",
    )
    deleted_by_gc = {
        e["objectRef"]["resource"]
        for e in control_plane.audit_events(GC)
        if e["verb"] == "delete" and e["objectRef"].get("namespace") == namespace
    }
    assert {"deployments", "services", "poddisruptionbudgets"} <= deleted_by_gc
    operator_deletes = [
        e for e in release.operator_requests()
        if e["verb"] == "delete" and (e.get("objectRef") or {}).get("namespace") == namespace
    ]  # fmt: skip
    assert operator_deletes == []


# -- the schema on the real server ---------------------------------------------------------------


@pytest.mark.parametrize(("case", "patch", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_llmdeployment_is_refused_by_the_api_server(
    control_plane: ControlPlane, release: Release, case: str, patch: dict[str, Any], message: str
) -> None:
    manifest = merge(_sample("minimal", "default"), patch)
    # Strict: the server refuses unknown fields too (kubectl's default would only warn).
    refused = control_plane.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=json.dumps(manifest), check=False
    )
    assert refused.returncode != 0, f"{case} was accepted"
    assert message in refused.stderr, refused.stderr


def test_accepted_manifest_is_stored_with_defaults(control_plane: ControlPlane, release: Release) -> None:
    manifest = copy.deepcopy(_sample("minimal", "default"))
    manifest["spec"]["resources"] = {"cpu": "0.5", "memory": "1e3"}  # canonicalised by the server in the pod
    stored = json.loads(
        control_plane.kubectl(
            "apply", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(manifest)
        ).stdout
    )
    assert stored["spec"]["replicas"] == 1
    assert stored["spec"]["resources"]["gpus"] == 1
    assert stored["spec"]["rollout"] == {"maxSurge": 1, "maxUnavailable": 0}


# -- routing ---------------------------------------------------------------------------------------

ROUTER_CHILDREN = ("serviceaccount", "role", "rolebinding", "deployment", "service")


def test_routing_kvasir_deploys_the_router_under_the_charts_rbac(
    control_plane: ControlPlane, release: Release, namespace: str
) -> None:
    """spec.routing.mode kvasir on a real API server: the operator (under the chart's ClusterRole,
    which must hold pods/list for RBAC to let it grant the router's Role) creates the router's
    children, owned by the LLMDeployment, points status.endpoint at the router's Service, and
    deletes them again when the mode goes back to none."""
    routed = merge(_sample("minimal", namespace), {"spec": {"replicas": 0, "routing": {"mode": "kvasir"}}})
    _apply(control_plane, routed)
    obj = _status_where(
        control_plane,
        release,
        namespace,
        "smollm2",
        "the endpoint at the router",
        lambda o: (o.get("status") or {}).get("endpoint") == f"http://smollm2-router.{namespace}.svc:8000",
    )
    # Ready or not depends on whether the router's pod runs on this control plane's node agent.
    assert condition(obj, "Routed")["reason"] in {"RouterReady", "RouterNotReady"}
    for kind in ROUTER_CHILDREN:
        child = wait_for(
            lambda k=kind: (
                control_plane.kubectl("get", k, "smollm2-router", "-n", namespace, check=False).returncode
                == 0
                and control_plane.kubectl_json("get", k, "smollm2-router", "-n", namespace)
            ),
            f"the router's {kind}",
        )
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "LLMDeployment",
            obj["metadata"]["uid"],
            True,
        )
    role = control_plane.kubectl_json("get", "role", "smollm2-router", "-n", namespace)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    # The router's account may list the pods (what `kvasir router --deployment` does), nothing more.
    account = f"system:serviceaccount:{namespace}:smollm2-router"
    can = control_plane.kubectl(
        "auth", "can-i", "list", "pods", "-n", namespace, "--as", account, check=False
    )
    assert can.stdout.strip() == "yes"
    cannot = control_plane.kubectl(
        "auth", "can-i", "get", "secrets", "-n", namespace, "--as", account, check=False
    )
    assert cannot.stdout.strip() == "no"

    _apply(control_plane, merge(routed, {"spec": {"routing": {"mode": "none"}}}))
    for kind in ROUTER_CHILDREN:
        wait_for(
            lambda k=kind: (
                control_plane.kubectl("get", k, "smollm2-router", "-n", namespace, check=False).returncode
                != 0
            ),
            f"the router's {kind} deleted",
        )
    _status_where(
        control_plane,
        release,
        namespace,
        "smollm2",
        "the endpoint back at the model's Service",
        lambda o: (
            (o.get("status") or {}).get("endpoint") == f"http://smollm2.{namespace}.svc:8000"
            and not condition(o, "Routed")
        ),
    )
