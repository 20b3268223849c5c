"""Parallelism in the pods: `resources.gpus: N` is one pod with N GPUs, `--tensor-parallel-size N`
and a /dev/shm sized for the ranks; `spec.parallelism.nodes` above 1 is a LeaderWorkerSet of groups
whose leaders alone serve, each pod's flags read by the runtime's own parser as the kubelet would
hand them over. Every pod template validates strictly as a Pod of current Kubernetes."""

from __future__ import annotations

import argparse
from typing import Any

import kubernetes_validate
import pytest

from kvasir.operator import naming
from kvasir.operator.api.spec import parse_spec
from kvasir.operator.children.deployment import build_runtime_args
from kvasir.operator.children.manifests import build_children
from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
from kvasir.runtime.parallel.topology import NodeLayout
from kvasir.runtime.server.config import add_server_args, server_config_from_args
from kvasir.runtime.server.headless import check_node_role

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
    "parallelism": {"tensor": 16, "nodes": 2},
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
        assert args[args.index("--tensor-parallel-size") + 1] == "16"
        assert "--pipeline-parallel-size" not in args
        assert args[args.index("--nnodes") + 1] == "2"
        # Where the group meets: the leader pod's name, from the variable LeaderWorkerSet sets.
        assert args[args.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
        assert _shm(template) == "16Gi"
        assert naming.selector_labels("big").items() <= template["metadata"]["labels"].items()
    leader, worker = _container(group["leaderTemplate"]), _container(group["workerTemplate"])
    assert (
        "--headless" not in leader["args"] and leader["args"][leader["args"].index("--node-rank") + 1] == "0"
    )
    assert worker["args"][:2] == ["serve", "--headless"]
    assert worker["args"][worker["args"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    # A headless node answers /health and /ready on the runtime's port: the same probes fit it.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert worker[probe] == leader[probe]
    assert worker["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert worker["livenessProbe"]["httpGet"]["path"] == "/health"
    assert "annotations" not in group["workerTemplate"]["metadata"]  # no /metrics on a worker


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


# What LeaderWorkerSet's webhook puts in every container of group 3's pod at index 1 of an LWS named
# "big" (kubernetes-sigs/lws: LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX), for the kubelet's
# $(VAR) expansion of the args.
LWS_ENV = {"LWS_LEADER_ADDRESS": "big-3.big.team-a", "LWS_GROUP_SIZE": "2"}


def _expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """`args` as the kubelet hands them over: $(VAR) replaced from the container's environment;
    a reference to a variable the container lacks would stay as written (and fail the parser)."""
    out = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        assert "$(" not in arg, f"{arg} refers to a variable LeaderWorkerSet does not set"
        out.append(arg)
    return out


def test_every_pod_of_a_group_parses_to_its_place_in_the_group() -> None:
    """The rendered args, expanded as the kubelet would, read by `kvasir serve`'s own parser: the
    leader is node 0 and serves, the worker is node 1, headless, ranks 8-15, both meeting at the
    leader's address; the worker waits for the leader's rendezvous as long as the leader may take
    to start."""
    group = build_children("big", "team-a", parse_spec(MULTI_NODE), with_service_monitor=False)
    lws = next(child for child in group if child["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    places = []
    for role, index in (("leaderTemplate", "0"), ("workerTemplate", "1")):
        args = _expanded(_container(lws[role])["args"], {**LWS_ENV, "LWS_WORKER_INDEX": index})
        assert args[0] == "serve"
        parsed = _serve_parser().parse_args(args[1:])
        engine, server = engine_config_from_args(parsed), server_config_from_args(parsed)
        check_node_role(engine, server)  # node 0 serves, the others are headless
        layout = NodeLayout.of(engine)
        places.append(
            (server.headless, layout.node_rank, list(layout.ranks), layout.master_addr, server.port)
        )
        timeout = engine.distributed_timeout_seconds
    assert places == [
        (False, 0, list(range(8)), "big-3.big.team-a", 8000),
        (True, 1, list(range(8, 16)), "big-3.big.team-a", 8000),
    ]
    assert timeout == 1800  # the worker's: runtime.startupTimeoutSeconds' default


def test_a_distributed_timeout_in_extra_args_wins_on_the_workers() -> None:
    spec = {**MULTI_NODE, "runtime": {"extraArgs": ["--distributed-timeout-seconds", "300"]}}
    group = build_children("big", "team-a", parse_spec(spec), with_service_monitor=False)
    lws = next(child for child in group if child["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    args = _expanded(_container(lws["workerTemplate"])["args"], {**LWS_ENV, "LWS_WORKER_INDEX": "1"})
    assert engine_config_from_args(_serve_parser().parse_args(args[1:])).distributed_timeout_seconds == 300


def test_pipeline_stages_are_refused_before_anything_is_built() -> None:
    from kvasir.operator.api.source import SpecError

    spec = {**MULTI_NODE, "resources": {"gpus": 8}, "parallelism": {"tensor": 8, "pipeline": 2, "nodes": 2}}
    with pytest.raises(SpecError, match="above 1 is not supported: the runtime has no pipeline parallelism"):
        parse_spec(spec)


def test_extra_args_cannot_set_a_tensor_size_the_gpus_disagree_with() -> None:
    from kvasir.operator.api.source import SpecError

    for extra in (["--tensor-parallel-size", "4"], ["--tensor-parallel-size=4"]):
        with pytest.raises(SpecError, match="--tensor-parallel-size is set by the operator"):
            parse_spec({"model": {"source": "/m"}, "runtime": {"extraArgs": extra}})
