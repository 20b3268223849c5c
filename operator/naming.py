"""Fixed names, API coordinates and labels shared by the CRD, the builders and the handlers."""

from __future__ import annotations

from collections.abc import Mapping

GROUP = "inference.kvasir.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SHORT_NAME = "llmd"

# Who manages the children: used in labels, the fieldManager of every write and event sources.
MANAGER = "kvasir-operator"
# kopf keeps its own bookkeeping (progress, last handled spec) in annotations with this prefix,
# never in .status, so the structural status schema stays exactly what users see.
ANNOTATION_PREFIX = "kvasir.dev"

# The runtime's HTTP contract (docs/serving.md): one port for the API, probes and metrics.
RUNTIME_PORT = 8000
RUNTIME_PORT_NAME = "http"
HEALTH_PATH = "/health"
READY_PATH = "/ready"
METRICS_PATH = "/metrics"
CONTAINER_NAME = "kvasir"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_VERSION = "app.kubernetes.io/version"

# LeaderWorkerSet sets this label on every pod of a group: "0" on the leader, 1..size-1 on the
# workers. Only leaders serve the API, so a multi-node group is one replica to the Service, the
# router, the autoscaler and status; a pod without the label (a Deployment's) serves.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_LEADER_INDEX = "0"


def selector_labels(name: str) -> dict[str, str]:
    """The immutable pod selector of one LLMDeployment: never add a label that can change."""
    return {LABEL_NAME: "kvasir", LABEL_INSTANCE: name}


def serving_selector(name: str, multi_node: bool) -> dict[str, str]:
    """The pods that answer requests: all of a Deployment's, only the leaders of a group's."""
    labels = selector_labels(name)
    if multi_node:
        labels[LWS_WORKER_INDEX_LABEL] = LWS_LEADER_INDEX
    return labels


def serves_requests(labels: Mapping[str, str]) -> bool:
    """Whether a pod with these labels serves the API (a Deployment's pod, or a group's leader)."""
    return labels.get(LWS_WORKER_INDEX_LABEL, LWS_LEADER_INDEX) == LWS_LEADER_INDEX


def common_labels(name: str, image: str) -> dict[str, str]:
    """The app.kubernetes.io/* labels every child and pod carries."""
    labels = selector_labels(name)
    labels[LABEL_COMPONENT] = "inference-server"
    labels[LABEL_PART_OF] = "kvasir"
    labels[LABEL_MANAGED_BY] = MANAGER
    tag = image_tag(image)
    if tag:
        labels[LABEL_VERSION] = tag
    return labels


def image_tag(image: str) -> str:
    """The tag of an image reference ('' for a digest-only or untagged image); label-safe."""
    reference = image.split("@", 1)[0]
    last = reference.rsplit("/", 1)[-1]
    if ":" not in last:
        return ""
    tag = last.split(":", 1)[1]
    # A label value is at most 63 characters of [A-Za-z0-9._-]; tags already use that alphabet.
    return tag[:63].strip("._-")


def selector_string(labels: Mapping[str, str]) -> str:
    """A label selector in the string form the scale subresource reports (`k=v,k=v`)."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def endpoint_url(name: str, namespace: str, port: int) -> str:
    """The in-cluster URL of the OpenAI-compatible endpoint of one LLMDeployment."""
    return f"http://{name}.{namespace}.svc:{port}"
