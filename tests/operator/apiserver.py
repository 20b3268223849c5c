"""What a real kube-apiserver does and kmock's emulator does not, added to kmock as a reaction.

kmock stores objects exactly as sent, merges a PATCH, does not serve PUT, and keeps no
resourceVersion, generation or managedFields. A real server:

- answers PUT by replacing the whole object, and 409 when its metadata.resourceVersion is stale;
- stores quantities canonically (`0.5` -> `"500m"`, `1` -> `"1"`, `1024Mi` -> `"1Gi"`);
- fills defaults (a container's terminationMessagePath, a probe's scheme and successThreshold,
  a Service's clusterIP and ipFamilies, ...) and drops empty lists (Go's omitempty);
- sets uid, creationTimestamp, a new resourceVersion on every write, generation on spec changes,
  and managedFields naming the writer.

Only the children kinds get this treatment (the parent keeps kmock's behaviour, which kopf's
tests rely on). The canonical quantities come from a table written from Kubernetes' documented
behaviour, not from the operator's own canonicaliser, so the tests stay independent of it: a
quantity missing from the table fails the test loudly instead of passing unnoticed.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import uuid
from typing import Any

import kmock

CHILD_KINDS = {
    "apps/v1/deployments": "Deployment",
    "v1/services": "Service",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
    "monitoring.coreos.com/v1/servicemonitors": "ServiceMonitor",
    "v1/serviceaccounts": "ServiceAccount",
    "rbac.authorization.k8s.io/v1/roles": "Role",
    "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
    "inference.networking.k8s.io/v1/inferencepools": "InferencePool",
    "v1/configmaps": "ConfigMap",
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": "LeaderWorkerSet",
}
HAS_GENERATION = {"Deployment", "PodDisruptionBudget", "ServiceMonitor", "InferencePool", "LeaderWorkerSet"}
# Go structs; custom resources stay as sent
BUILT_IN = {
    "Deployment",
    "Service",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
}
WITHOUT_SPEC = {"ServiceAccount", "Role", "RoleBinding", "ConfigMap"}

# Input -> what kube-apiserver stores (resource.Quantity's canonical form).
CANONICAL_QUANTITIES: dict[Any, str] = {
    0.5: "500m",
    "0.5": "500m",
    "500m": "500m",
    1: "1",
    "1": "1",
    2: "2",
    "2": "2",
    4: "4",
    "4": "4",
    "8": "8",
    "256Mi": "256Mi",  # the router's memory request (operator/children/routing.py)
    "1Gi": "1Gi",
    "1024Mi": "1Gi",
    "2Gi": "2Gi",
    "8Gi": "8Gi",
    "16Gi": "16Gi",
    "24Gi": "24Gi",
    "32Gi": "32Gi",
    "64Gi": "64Gi",
    "100Gi": "100Gi",
    "200Gi": "200Gi",
    "1.5Gi": "1536Mi",
    "16G": "16G",
    "16000M": "16G",
}

# A canonical value is stored as it is.
CANONICAL_QUANTITIES.update({stored: stored for stored in list(CANONICAL_QUANTITIES.values())})

_versions = itertools.count(1000)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _canonical(value: Any, where: str) -> str:
    try:
        return CANONICAL_QUANTITIES[value]
    except KeyError:
        raise AssertionError(f"add {value!r} ({where}) to CANONICAL_QUANTITIES in {__file__}") from None


def _omitempty(value: Any) -> Any:
    """Drop None and empty lists, as Go's omitempty does when the server re-encodes an object."""
    if isinstance(value, dict):
        return {k: _omitempty(v) for k, v in value.items() if v is not None and v != []}
    if isinstance(value, list):
        return [_omitempty(v) for v in value]
    return value


def _probe(probe: dict[str, Any]) -> None:
    probe.setdefault("timeoutSeconds", 1)
    probe.setdefault("periodSeconds", 10)
    probe.setdefault("successThreshold", 1)
    probe.setdefault("failureThreshold", 3)
    if "httpGet" in probe:
        probe["httpGet"].setdefault("scheme", "HTTP")


def _pod_template(template: dict[str, Any]) -> None:
    pod = template.setdefault("spec", {})
    pod.setdefault("restartPolicy", "Always")
    pod.setdefault("terminationGracePeriodSeconds", 30)
    pod.setdefault("dnsPolicy", "ClusterFirst")
    pod.setdefault("schedulerName", "default-scheduler")
    pod.setdefault("securityContext", {})
    for volume in pod.get("volumes") or []:
        if "emptyDir" in volume and "sizeLimit" in volume["emptyDir"]:
            volume["emptyDir"]["sizeLimit"] = _canonical(volume["emptyDir"]["sizeLimit"], "sizeLimit")
    for container in pod.get("containers") or []:
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("imagePullPolicy", "IfNotPresent")
        for port in container.get("ports") or []:
            port.setdefault("protocol", "TCP")
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            if kind in container:
                _probe(container[kind])
        resources = container.setdefault("resources", {})
        for section in ("requests", "limits"):
            for name, amount in (resources.get(section) or {}).items():
                resources[section][name] = _canonical(amount, f"resources.{section}.{name}")


def _defaults(kind: str, obj: dict[str, Any]) -> None:
    if kind in WITHOUT_SPEC:
        return
    spec = obj.setdefault("spec", {})
    if kind == "Deployment":
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        spec.setdefault(
            "strategy",
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
        )
        _pod_template(spec.setdefault("template", {}))
    elif kind == "Service":
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        spec.setdefault("clusterIP", f"10.96.{next(_versions) % 250}.{next(_versions) % 250}")
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            if spec["type"] in ("NodePort", "LoadBalancer"):
                port.setdefault("nodePort", 30000 + next(_versions) % 2000)
        if spec["type"] == "LoadBalancer":
            spec.setdefault("allocateLoadBalancerNodePorts", True)
            spec.setdefault("externalTrafficPolicy", "Cluster")


def normalize(
    kind: str, obj: dict[str, Any], previous: dict[str, Any] | None, manager: str
) -> dict[str, Any]:
    """The object as the API server stores it after a write of `obj` over `previous`."""
    stored = _omitempty(copy.deepcopy(obj)) if kind in BUILT_IN else copy.deepcopy(obj)
    stored.pop("status", None)
    if previous is not None and "status" in previous:
        stored["status"] = copy.deepcopy(previous["status"])
    _defaults(kind, stored)
    meta = stored.setdefault("metadata", {})
    before = (previous or {}).get("metadata") or {}
    meta["uid"] = before.get("uid") or meta.get("uid") or str(uuid.uuid4())
    meta["creationTimestamp"] = before.get("creationTimestamp") or _now()
    meta["resourceVersion"] = str(next(_versions))
    if kind in HAS_GENERATION:
        generation = int(before.get("generation") or 0)
        changed = previous is None or previous.get("spec") != stored.get("spec")
        meta["generation"] = generation + 1 if changed else generation
    meta["managedFields"] = [
        {
            "manager": manager,
            "operation": "Update",
            "apiVersion": stored.get("apiVersion", ""),
            "time": _now(),
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {}, "f:spec": {}},
        }
    ]
    return stored


def _key(request: Any) -> tuple[Any, Any, Any]:
    name = request.name or ((request.data or {}).get("metadata") or {}).get("name")
    namespace = request.namespace or ((request.data or {}).get("metadata") or {}).get("namespace")
    return (request.resource, namespace, name)


def install(emulator: Any) -> dict[str, int]:
    """Add the API server's semantics to a kmock emulator; returns counters the tests may read."""
    counters = {"conflicts": 0, "puts": 0}

    async def publish(resource: Any, stored: dict[str, Any]) -> None:
        # kmock has no public way to emit a watch event for a direct store change.
        await emulator._buses[resource].put({"type": "MODIFIED", "object": copy.deepcopy(stored)})

    async def react(request: Any) -> Any:
        resource = next(
            (r for r in CHILD_KINDS if request.resource is not None and request.resource == r), ""
        )
        kind = CHILD_KINDS.get(resource)
        method = str(getattr(request.method, "value", request.method)).upper()
        if kind is None or request.subresource or method not in {"POST", "PUT", "PATCH"}:
            raise NotImplementedError  # kmock's own behaviour
        manager = request.params.get("fieldManager") or request.headers.get("User-Agent", "unknown")
        key = _key(request)
        try:
            obj = emulator.objects[key]
        except KeyError:
            obj = None
        if method == "PUT":
            counters["puts"] += 1
            if obj is None or obj.deleted:
                return kmock.KubernetesError(
                    status=404, reason="NotFound", message=f"{kind} {key[2]} not found"
                )
            current = copy.deepcopy(obj.raw)
            sent = (request.data.get("metadata") or {}).get("resourceVersion")
            if sent != current["metadata"].get("resourceVersion"):
                counters["conflicts"] += 1
                return kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message=f'Operation cannot be fulfilled on {resource} "{key[2]}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            stored = normalize(kind, request.data, current, manager)
        else:
            assert obj is not None and not obj.deleted  # kmock stored the POST/PATCH already
            history = [v for v in obj.history if v is not None]
            previous = copy.deepcopy(history[-2].raw) if method == "PATCH" and len(history) > 1 else None
            stored = normalize(kind, copy.deepcopy(obj.raw), previous, manager)
        obj.history.append(stored)
        await publish(request.resource, stored)
        return copy.deepcopy(stored)

    (emulator**-1) << react
    return counters
