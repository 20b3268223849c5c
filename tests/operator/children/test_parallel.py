"""Parallelism in the pods: `resources.gpus: N` is one pod with N GPUs, `--tensor-parallel-size N`
and a /dev/shm sized for the ranks; `spec.parallelism.nodes` above 1 is a LeaderWorkerSet of groups
whose leaders alone serve. Every pod template validates strictly as a Pod of current Kubernetes."""

from __future__ import annotations

import argparse
from typing import Any

import kubernetes_validate
import pytest

from kvasir.operator import naming
from kvasir.operator.api.spec import parse_spec
from kvasir.operator.children.deployment import build_runtime_args
from kvasir.operator.children.manifests import build_children
from kvasir.runtime.engine_args import add_engine_args
from kvasir.runtime.server.config import add_server_args

K8S_VERSION = kubernetes_validate.utils.latest_version()
LEADER = {naming.LWS_WORKER_INDEX_LABEL: "0"}


def _children(spec: dict[str, Any], **flags: bool) -> dict[str, dict[str, Any]]:
    built = build_children("big", "team-a", parse_spec(spec), with_service_monitor=True, **flags)
    return {child["kind"]: child for child in built}


def _pod(template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]}, **template}


def _container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]


def _shm(template: dict[str, Any]) -> str:
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "dshm")
    return str(volume["emptyDir"]["sizeLimit"])


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvasir serve", exit_on_error=False)
    add_engine_args(parser)
    add_server_args(parser)
    return parser


def test_two_gpus_are_one_pod_with_both_and_tensor_parallel_two(samples) -> None:
    children = _children(samples["tensor-parallel"]["spec"])
    template = children["Deployment"]["spec"]["template"]
    kubernetes_validate.validate(children["Deployment"], K8S_VERSION, strict=True)
    container = _container(template)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--pipeline-parallel-size" not in args
    # The runtime's own parser reads the flag as the spec meant it.
    parsed = _serve_parser().parse_args(args[1:])
    assert parsed.tensor_parallel_size == 2
    assert _shm(template) == "4Gi"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_one_gpu_pods_are_unchanged_by_the_parallelism_code() -> None:
    """No flag at TP=1: an operator upgrade must not roll every single-GPU deployment."""
    for gpus in (0, 1):
        spec = parse_spec({"model": {"source": "/m"}, "resources": {"gpus": gpus}})
        assert "--tensor-parallel-size" not in build_runtime_args(spec)
        template = _children({"model": {"source": "/m"}, "resources": {"gpus": gpus}})["Deployment"]
        assert _shm(template["spec"]["template"]) == "1Gi"


@pytest.mark.parametrize(
    ("gpus", "shm_size", "expected"),
    [(2, "1Gi", "4Gi"), (8, "1Gi", "16Gi"), (4, "32Gi", "32Gi"), (4, "8Gi", "8Gi"), (4, "6000Mi", "8Gi")],
)
def test_shm_is_at_least_two_gib_per_gpu_and_never_lowered(gpus, shm_size, expected) -> None:
    spec = {"model": {"source": "/m"}, "resources": {"gpus": gpus, "shmSize": shm_size}}
    assert _shm(_children(spec)["Deployment"]["spec"]["template"]) == expected


def test_parallelism_on_one_node_sets_the_tensor_size_it_names() -> None:
    spec = {"model": {"source": "/m"}, "resources": {"gpus": 4}, "parallelism": {"tensor": 4}}
    args = build_runtime_args(parse_spec(spec))
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert "LeaderWorkerSet" not in _children(spec)


MULTI_NODE = {
    "model": {"source": "pvc://weights"},
    "replicas": 3,
    "resources": {"gpus": 8},
    "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2},
    "routing": {"mode": "gateway", "endpointPicker": {"service": "epp"}},
}


def test_multi_node_is_a_leader_worker_set_of_groups_not_a_deployment() -> None:
    children = _children(MULTI_NODE)
    assert "Deployment" not in children
    lws = children["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "big"
    spec = lws["spec"]
    assert spec["replicas"] == 3  # groups: the LLMDeployment's replicas
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxUnavailable": 0, "maxSurge": 1}
    for role in ("leaderTemplate", "workerTemplate"):
        template = group[role]
        kubernetes_validate.validate(_pod(template), K8S_VERSION, strict=True)
        container = _container(template)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "8"
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
        # The group's rendezvous, from the variables LeaderWorkerSet puts in every container.
        assert args[args.index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
        assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        assert args[args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
        assert _shm(template) == "16Gi"
        assert naming.selector_labels("big").items() <= template["metadata"]["labels"].items()
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    assert "readinessProbe" in _container(leader) and "--headless" not in _container(leader)["args"]
    assert _container(worker)["args"][:2] == ["serve", "--headless"]
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(_container(worker))
    assert "annotations" not in worker["metadata"]  # no scrape of a pod that serves nothing


def test_only_a_groups_leader_is_behind_the_service_and_the_pool() -> None:
    children = _children(MULTI_NODE)
    assert children["Service"]["spec"]["selector"] == naming.selector_labels("big") | LEADER
    assert (
        children["InferencePool"]["spec"]["selector"]["matchLabels"] == naming.selector_labels("big") | LEADER
    )
    # Drains count every pod of a group, workers included.
    assert children["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == naming.selector_labels("big")
    kubernetes_validate.validate(children["Service"], K8S_VERSION, strict=True)


def test_without_the_leader_worker_set_crd_nothing_runs_the_group() -> None:
    children = _children(MULTI_NODE, with_leader_worker_set=False)
    assert not {"Deployment", "LeaderWorkerSet"} & set(children)


def test_the_multi_node_sample_builds_a_leader_worker_set(samples) -> None:
    children = _children(samples["multi-node"]["spec"])
    group = children["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert _container(group["leaderTemplate"])["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_serving_pods_are_deployment_pods_and_leaders() -> None:
    assert naming.serves_requests(naming.selector_labels("x"))
    assert naming.serves_requests(LEADER)
    assert not naming.serves_requests({naming.LWS_WORKER_INDEX_LABEL: "1"})


def test_the_runtime_does_not_accept_the_group_flags_yet() -> None:
    """A multi-node group's pods cannot run today: `kvasir serve` refuses the flags they get.
    docs/tensor-parallel.md ("What has never run") says so; when this fails, the runtime has
    learnt them, and the page and this test must change."""
    group = build_children("big", "team-a", parse_spec(MULTI_NODE), with_service_monitor=False)
    lws = next(child for child in group if child["kind"] == "LeaderWorkerSet")
    args = _container(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["args"]
    _, unknown = _serve_parser().parse_known_args(args[1:])
    assert unknown[::2] == ["--pipeline-parallel-size", "--nnodes", "--node-rank", "--master-addr"]


def test_extra_args_cannot_set_a_tensor_size_the_gpus_disagree_with() -> None:
    from kvasir.operator.api.source import SpecError

    for extra in (["--tensor-parallel-size", "4"], ["--tensor-parallel-size=4"]):
        with pytest.raises(SpecError, match="--tensor-parallel-size is set by the operator"):
            parse_spec({"model": {"source": "/m"}, "runtime": {"extraArgs": extra}})
