"""Pure builders: what each manifest contains, and that every manifest built for the samples is
valid (strictly: no unknown fields) for a current Kubernetes."""

from __future__ import annotations

import kubernetes_validate
import pytest

from kvasir.operator import naming
from kvasir.operator.api.spec import parse_spec
from kvasir.operator.children.deployment import build_runtime_args, termination_grace_seconds
from kvasir.operator.children.manifests import build_children

K8S_VERSION = kubernetes_validate.utils.latest_version()


def _children(sample: dict, monitor: bool = True) -> dict[str, dict]:
    meta = sample["metadata"]
    spec = parse_spec(sample["spec"])
    built = build_children(meta["name"], meta.get("namespace", "default"), spec, with_service_monitor=monitor)
    return {child["kind"]: child for child in built}


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", ["minimal", "autoscaling", "pvc-model", "full", "shared-cache"])
def test_every_manifest_validates_strictly(samples, name) -> None:
    children = _children(samples[name])
    assert set(children) == {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"}
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        kubernetes_validate.validate(children[kind], K8S_VERSION, strict=True)
    # The Prometheus Operator's CRD is not in the Kubernetes schemas; check its shape by hand.
    monitor = children["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"] == children["Service"]["spec"]["selector"]
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]


def test_an_invalid_manifest_is_caught_by_the_validator(samples) -> None:
    deployment = _children(samples["minimal"])["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_runtime_args_map_every_flag(samples) -> None:
    args = build_runtime_args(parse_spec(samples["full"]["spec"]))
    assert args == [
        "serve",
        "--model", "mistralai/Mistral-7B-Instruct-v0.3",
        "--revision", "main",
        "--served-model-name", "mistral-7b",
        "--dtype", "bfloat16",
        "--max-model-len", "16384",
        "--max-num-seqs", "128",
        "--max-num-batched-tokens", "4096",
        "--block-size", "16",
        "--kv-cache-memory-fraction", "0.85",
        "--kv-cache-dtype", "fp8",
        "--enable-prefix-caching",
        "--speculative-config",
        '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}',
        "--download-dir", "/models",
        "--host", "0.0.0.0",  # kvasir serve listens on loopback unless told
        "--port", "8000",
        "--drain-timeout", "60",
        "--log-level=info",
    ]  # fmt: skip


def test_defaults_and_disabled_prefix_caching() -> None:
    spec = parse_spec({"model": {"source": "hf://org/name"}, "runtime": {"enablePrefixCaching": False}})
    args = build_runtime_args(spec)
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert "--max-model-len" not in args  # unset: the model's own limit
    assert args[args.index("--served-model-name") + 1] == "org/name"


def test_deployment_is_rollout_safe_and_hardened(samples) -> None:
    deployment = _children(samples["minimal"])["Deployment"]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    container = _container(deployment)
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # tolerates long loads
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert pod["terminationGracePeriodSeconds"] > 5 + 30  # preStop pause + default drain
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    # Canonical quantities, as the API server stores them (an int 1 would come back as "1").
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["model-cache"]["emptyDir"] == {}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", "/tmp", "/models"} <= mounts  # every writable path is a volume
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }


def test_labels_and_immutable_selector(samples) -> None:
    children = _children(samples["full"])
    deployment = children["Deployment"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "kvasir", "app.kubernetes.io/instance": "mistral-7b"}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert labels["app.kubernetes.io/managed-by"] == naming.MANAGER
    assert labels["app.kubernetes.io/version"] == "0.1.0"
    for child in children.values():
        assert child["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvasir"
    # An image change re-labels the pods but never touches the selector.
    other = parse_spec(samples["full"]["spec"] | {"runtime": {"image": "registry:5000/kvasir@sha256:abc"}})
    rebuilt = build_children("mistral-7b", "inference", other, with_service_monitor=False)[0]
    assert rebuilt["spec"]["selector"] == deployment["spec"]["selector"]
    assert "app.kubernetes.io/version" not in rebuilt["metadata"]["labels"]


def test_pvc_source_mounts_the_claim_read_only(samples) -> None:
    deployment = _children(samples["pvc-model"])["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "model-store", "readOnly": True}
    assert "model-cache" not in volumes
    args = _container(deployment)["args"]
    assert args[args.index("--model") + 1] == "/models/qwen2.5-7b-instruct"
    assert "--download-dir" not in args
    assert deployment["spec"]["replicas"] == 2


def test_local_path_and_cpu_only() -> None:
    spec = parse_spec({"model": {"source": "/opt/models/smollm2/"}, "resources": {"gpus": 0}})
    deployment = build_children("cpu", "ns", spec, with_service_monitor=False)[0]
    container = _container(deployment)
    assert container["args"][container["args"].index("--model") + 1] == "/opt/models/smollm2"
    assert container["args"][container["args"].index("--served-model-name") + 1] == "smollm2"
    assert all("gpu" not in key for key in container["resources"]["limits"])
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_scheduling_token_and_grace(samples) -> None:
    spec = parse_spec(samples["full"]["spec"])
    deployment = _children(samples["full"])["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["affinity"]["podAntiAffinity"]
    assert pod["priorityClassName"] == "inference-high"
    env = {e["name"]: e for e in _container(deployment)["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert pod["terminationGracePeriodSeconds"] == termination_grace_seconds(spec) == 5 + 60 + 15


def test_service_and_pdb(samples) -> None:
    children = _children(samples["full"])
    service, pdb = children["Service"], children["PodDisruptionBudget"]
    assert service["spec"]["ports"][0]["port"] == 8000
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == children["Deployment"]["spec"]["selector"]


def test_autoscaling_starts_at_min_replicas(samples) -> None:
    assert _children(samples["autoscaling"])["Deployment"]["spec"]["replicas"] == 1
    assert _children(samples["minimal"])["Deployment"]["spec"]["replicas"] == 1


def test_monitor_only_when_asked_and_enabled(samples) -> None:
    assert "ServiceMonitor" not in _children(samples["full"], monitor=False)
    off = samples["full"] | {"spec": samples["full"]["spec"] | {"monitoring": {"enabled": False}}}
    assert "ServiceMonitor" not in _children(off)


def test_the_startup_probe_waits_for_the_model(samples) -> None:
    """/health answers while the model loads; only /ready proves it loaded, so the startup probe
    (and with it startupTimeoutSeconds) is on /ready and a hung download gets restarted."""
    container = _container(_children(samples["minimal"])["Deployment"])
    assert container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800


def test_pod_settings_users_expect(samples) -> None:
    deployment = _children(samples["full"])["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["runtimeClassName"] == "nvidia"
    (spread,) = pod["topologySpreadConstraints"]
    # Without a selector a constraint counts no pods: it defaults to this deployment's own.
    assert spread["labelSelector"] == {"matchLabels": naming.selector_labels("mistral-7b")}
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    env = {e["name"]: e for e in _container(deployment)["env"]}
    assert env["KVASIR_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "mistral-api-key", "key": "api-key"}
    # The emptyDir download cache has a size: it is requested, so the node has the disk for it.
    assert _container(deployment)["resources"]["requests"]["ephemeral-storage"] == "40Gi"


def test_a_shared_cache_claim_replaces_the_per_pod_download(samples) -> None:
    deployment = _children(samples["shared-cache"])["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert volume == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    container = _container(deployment)
    assert {"name": "model-cache", "mountPath": "/models"} in container["volumeMounts"]
    assert "ephemeral-storage" not in container["resources"]["requests"]
    assert {"name": "HF_HOME", "value": "/models/.hf"} in container["env"]


def test_the_pod_listens_on_its_own_address() -> None:
    """`kvasir serve` binds 127.0.0.1 by default; in a pod the Service, the kubelet's probes and the
    router reach it at the pod's address, so the operator asks for every interface."""
    from kvasir.runtime.server.config import server_flag

    assert server_flag("--host").default == "127.0.0.1"
    args = build_runtime_args(parse_spec({"model": {"source": "hf://org/name"}}))
    assert args[args.index("--host") + 1] == "0.0.0.0"
    # extraArgs come last, so one of the user's own still wins.
    spec = parse_spec(
        {"model": {"source": "hf://org/name"}, "runtime": {"extraArgs": ["--host", "10.0.0.1"]}}
    )
    assert build_runtime_args(spec)[-2:] == ["--host", "10.0.0.1"]
