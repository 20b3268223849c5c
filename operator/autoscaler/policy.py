"""The autoscaler's tunables, declared once: each field of `Policy` is one knob of
`spec.autoscaling`, with its CRD key, group, range and description beside its default. From this
one declaration come the operator's parser (`parse_policy`, with its error messages), the CRD's
`spec.autoscaling` schema (`autoscaling_schema`, which tests compare with the committed CRD), and
the policy `decide()` and the simulator run. Adding a knob is one field here (plus its rule in
`decide()` and its test); `python -m kvasir.operator.crd_sync` writes it into the CRD.

Pure and torch-free: the simulator imports it without the operator's I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvasir.operator.api import validation
from kvasir.operator.api.kinds import whole_number
from kvasir.operator.api.source import SpecError

PATH = "spec.autoscaling"
# The sections of spec.autoscaling, with their descriptions; None is spec.autoscaling itself.
GROUPS: dict[str | None, str] = {
    None: "Let Kvasir's autoscaler choose the replica count from runtime metrics.",
    "targets": "Per-replica targets the autoscaler tracks (it takes the largest demand).",
    "windows": "How often and how cautiously the autoscaler acts.",
    "behavior": "How far and how fast one decision may go (see docs/autoscaling.md).",
    "scaleToZero": (
        "With minReplicas 0: how long the deployment must see no request before it scales to zero, and "
        "how Kvasir's router holds the requests that arrive while it has no replica (docs/autoscaling.md)."
    ),
    "slo": (
        "The latency objective the autoscaler holds with the fewest replicas (optional): set it and "
        "the observed TTFT and time-per-output-token percentiles become the targets, with KV usage, "
        "queue and the latency tail as leading signals. At least one of timeToFirstTokenSeconds and "
        "interTokenLatencySeconds."
    ),
}
# Sections with no default: absent means "not set" (an SLO nobody gave is not an SLO).
OPTIONAL_GROUPS = frozenset({"slo"})
SLO_RULE = (
    "has(self.timeToFirstTokenSeconds) || has(self.interTokenLatencySeconds)",
    "autoscaling.slo needs timeToFirstTokenSeconds or interTokenLatencySeconds",
)


@dataclass(frozen=True)
class Knob:
    """What the CRD and the parser need to know of one Policy field."""

    key: str  # the camelCase key in spec.autoscaling[.group]
    group: str | None
    low: float
    high: float
    description: str
    # Fractional bounds are a CEL range rule: kube-openapi truncates `minimum: 0.05` to 0 for an
    # integer input, so `kvCacheUsage: 0` would pass a plain minimum.
    range_rule: bool = False
    # A lower bound with a message of its own (a CEL rule), instead of `minimum`.
    low_message: str | None = None

    @property
    def path(self) -> str:
        return ".".join(part for part in (PATH, self.group, self.key) if part)

    @property
    def name(self) -> str:
        """How a CEL message names the field: `autoscaling.targets.kvCacheUsage`."""
        return self.path.removeprefix("spec.")


def knob(
    default: Any, key: str, group: str | None, low: float, high: float, description: str, **extra: Any
) -> Any:
    return field(default=default, metadata={"knob": Knob(key, group, low, high, description, **extra)})


@dataclass(frozen=True)
class Policy:
    """The tunables (docs/autoscaling.md explains each)."""

    max_replicas: int = field(metadata={"knob": Knob("maxReplicas", None, 1, 10_000, "The ceiling.")})
    min_replicas: int = knob(
        1,
        "minReplicas",
        None,
        0,
        10_000,
        "The floor. 0 scales to zero after scaleToZero.idleSeconds without requests (needs "
        "routing.mode kvasir: its router holds requests at zero and wakes the deployment).",
    )
    target_kv_cache_usage: float = knob(
        0.8, "kvCacheUsage", "targets", 0.05, 1, "Target KV-cache occupancy, from 0.05 to 1.", range_rule=True
    )
    target_queue_per_replica: float = knob(
        4.0, "queuePerReplica", "targets", 0, 100_000, "Target waiting requests per replica."
    )
    # Optional, off by default: the benchmark found no trace where it earned its place
    # (docs/autoscaling.md); None: off.
    target_latency_ratio: float | None = knob(
        None,
        "latencyRatio",
        "targets",
        1,
        1000,
        "P99/P50 latency ratio above which a saturated replica set scales up, when it is also 1.5x "
        "the deployment's own ratio at rest (optional; off when unset).",
    )
    # Optional: the mean inter-token latency to hold (seconds), tracked like a load; None: off.
    target_itl_seconds: float | None = knob(
        None,
        "interTokenLatencySeconds",
        "targets",
        0.001,
        60,
        "Mean inter-token latency to hold (0.001 to 60 seconds), tracked like a load (optional; off "
        "when unset). About 0.7 x the time-per-output-token SLO; it catches saturation that KV usage "
        "and the queue do not show, as on compute-bound replicas.",
        range_rule=True,
    )
    interval_seconds: int = knob(15, "intervalSeconds", "windows", 1, 3600, "Seconds between two decisions.")
    scale_up_stabilization_seconds: int = knob(
        0, "scaleUpSeconds", "windows", 0, 3600, "Stabilization window before scaling up."
    )
    scale_down_stabilization_seconds: int = knob(
        300,
        "scaleDownSeconds",
        "windows",
        0,
        86400,
        "Stabilization window before scaling down (the highest recommendation in it wins).",
    )
    metrics_window_seconds: int = knob(
        60,
        "metricsSeconds",
        "windows",
        10,
        3600,
        "The window over which rates and the P99/P50 latency ratios are computed.",
    )
    tolerance: float = knob(
        0.1,
        "tolerance",
        "behavior",
        0,
        0.5,
        "A signal within this fraction of its target asks for no change (0 to 0.5).",
        range_rule=True,
    )
    panic_threshold: float = knob(
        2.0,
        "panicThreshold",
        "behavior",
        1,
        100,
        "A queue per replica this many times its target triggers panic mode (act at once, no scale-down).",
    )
    panic_hold_seconds: int = knob(
        60,
        "panicHoldSeconds",
        "behavior",
        0,
        3600,
        "How long panic mode lasts after the queue last exploded.",
    )
    scale_up_max_pods: int = knob(
        4,
        "scaleUpMaxPods",
        "behavior",
        1,
        10_000,
        "A scale-up adds at most the larger of this many pods and scaleUpMaxPercent.",
    )
    scale_up_max_percent: int = knob(
        100,
        "scaleUpMaxPercent",
        "behavior",
        1,
        10_000,
        "A scale-up adds at most this percentage of the current replicas (or scaleUpMaxPods).",
    )
    scale_down_max_pods: int = knob(
        1,
        "scaleDownMaxPods",
        "behavior",
        1,
        10_000,
        "A scale-down removes at most the larger of this many pods and scaleDownMaxPercent.",
    )
    scale_down_max_percent: int = knob(
        50,
        "scaleDownMaxPercent",
        "behavior",
        0,
        100,
        "With an SLO readable, a scale-down removes at most this percentage of the current "
        "replicas, rounded down (or scaleDownMaxPods); without one, scaleDownMaxPods.",
    )
    scale_down_period_seconds: int = knob(
        60, "scaleDownPeriodSeconds", "behavior", 0, 3600, "At most one scale-down per this many seconds."
    )
    # Scale to zero (minReplicas 0): the idle time, and the router's hold (its --hold-timeout and
    # --max-held-requests). Read only when minReplicas is 0.
    idle_seconds: int = knob(
        900,
        "idleSeconds",
        "scaleToZero",
        1,
        86400,
        "Seconds without a request, at the router and at the pods, before the last replica goes; also "
        "the least time a replica woken from zero stays. Longer than the gaps between your requests, "
        "or every gap pays a cold start.",
    )
    hold_seconds: int = knob(
        300,
        "holdSeconds",
        "scaleToZero",
        1,
        3600,
        "How long the router holds a request while no replica is ready (its --hold-timeout); past it "
        "the request gets 503 with Retry-After. Longer than the cold start, which is minutes for a "
        "large model.",
    )
    max_held: int = knob(
        100,
        "maxHeld",
        "scaleToZero",
        0,
        100_000,
        "The most requests the router holds at once while no replica is ready (its "
        "--max-held-requests); more get 503 with Retry-After. 0 holds none.",
    )
    # The SLO (spec.autoscaling.slo): None latencies are no objective on that latency.
    slo_ttft_seconds: float | None = knob(
        None,
        "timeToFirstTokenSeconds",
        "slo",
        0.001,
        3600,
        "Time to first token (0.001 to 3600 seconds) that `attainment` of requests must meet.",
        range_rule=True,
    )
    slo_itl_seconds: float | None = knob(
        None,
        "interTokenLatencySeconds",
        "slo",
        0.0001,
        60,
        "A request's mean inter-token latency, its time per output token after the first (0.0001 "
        "to 60 seconds), that `attainment` of requests must meet.",
        range_rule=True,
    )
    slo_attainment: float = knob(
        0.99,
        "attainment",
        "slo",
        0.5,
        0.9999,
        "The fraction of requests that must meet the latencies (0.5 to 0.9999): the percentile the "
        "autoscaler reads.",
        range_rule=True,
    )
    # Not knobs of the CRD: the simulator's ablations (kvasir-no-ratio; use_prediction: the KV trend).
    use_latency_ratio: bool = True
    use_prediction: bool = True

    @property
    def slo(self) -> Slo | None:
        """The latency objective, or None when spec.autoscaling.slo names no latency."""
        if self.slo_ttft_seconds is None and self.slo_itl_seconds is None:
            return None
        return Slo(self.slo_ttft_seconds, self.slo_itl_seconds, self.slo_attainment)


@dataclass(frozen=True)
class Slo:
    """What `attainment` of requests must meet: TTFT and mean time per output token (None: no
    objective on that one)."""

    ttft_seconds: float | None
    itl_seconds: float | None
    attainment: float


def knobs() -> list[tuple[str, Knob, Any, bool]]:
    """(attribute, knob, default, is_integer) of every CRD knob, in declaration order."""
    out = []
    for item in fields(Policy):
        spec = item.metadata.get("knob")
        if spec is not None:
            default = None if item.default is MISSING else item.default
            # Annotations are strings here (`from __future__ import annotations`).
            out.append((item.name, spec, default, item.type == "int"))
    return out


# ---- the parser -----------------------------------------------------------------------------------


def _group(section: Mapping[str, Any], group: str | None) -> Mapping[str, Any]:
    return section if group is None else validation.section(section, group, PATH)


def _value(knob_: Knob, value: Any, integer: bool) -> int | float:
    wanted = "an integer" if integer else "a number"
    if integer and whole_number(value) is not None:
        value = whole_number(value)  # 3.0 is 3, as the API server stores it
    if (
        isinstance(value, bool)
        or not isinstance(value, int if integer else (int, float))
        or not math.isfinite(value)  # NaN and infinities are not JSON: kubectl cannot send them
    ):
        raise SpecError(knob_.path, f"must be {wanted}, got {value!r}")
    if knob_.low_message is not None and value < knob_.low:
        raise SpecError(knob_.path, knob_.low_message)
    if not knob_.low <= value <= knob_.high:
        raise SpecError(knob_.path, f"must be between {knob_.low:g} and {knob_.high:g}, got {value}")
    return value if integer else float(value)


def parse_policy(section: Mapping[str, Any]) -> Policy:
    """`spec.autoscaling`, with the CRD's defaults; SpecError naming the field when unusable."""
    if "maxReplicas" not in section:
        raise SpecError(f"{PATH}.maxReplicas", "is required")
    values: dict[str, Any] = {}
    for attr, knob_, default, integer in knobs():
        raw = _group(section, knob_.group).get(knob_.key)
        if raw is not None:
            values[attr] = _value(knob_, raw, integer)
        elif default is not None:
            values[attr] = default
    slo = _group(section, "slo")
    given = section.get("slo") is not None  # `slo: {}` is refused, as the CRD's rule refuses it
    if given and slo.get("timeToFirstTokenSeconds") is None and slo.get("interTokenLatencySeconds") is None:
        raise SpecError(f"{PATH}.slo", "needs timeToFirstTokenSeconds or interTokenLatencySeconds")
    policy = Policy(**values)
    if policy.min_replicas > policy.max_replicas:
        raise SpecError(f"{PATH}.minReplicas", "must be less than or equal to maxReplicas")
    return policy


# ---- the CRD ------------------------------------------------------------------------------------


def _plain(number: float) -> int | float:
    """4.0 is written 4, as in the CRD's YAML."""
    return int(number) if float(number).is_integer() else number


def _knob_schema(knob_: Knob, default: Any, integer: bool) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "integer" if integer else "number"}
    if default is not None:
        node["default"] = _plain(default)
    rules = []
    if knob_.range_rule:
        rules.append(
            {
                "rule": f"self >= {float(knob_.low)!r} && self <= {float(knob_.high)!r}",
                "message": f"{knob_.name} must be between {knob_.low:g} and {knob_.high:g}",
            }
        )
    else:
        if knob_.low_message is None:
            node["minimum"] = _plain(knob_.low)
        else:
            rules.append(
                {"rule": f"self >= {_plain(knob_.low)}", "message": f"{knob_.name} {knob_.low_message}"}
            )
        node["maximum"] = _plain(knob_.high)
    node["description"] = knob_.description
    if rules:
        node["x-kubernetes-validations"] = rules
    return node


def autoscaling_schema() -> dict[str, Any]:
    """The CRD's `spec.autoscaling` node, from the declaration."""
    groups: dict[str | None, dict[str, Any]] = {
        group: {"type": "object", "default": {}, "description": text, "properties": {}}
        for group, text in GROUPS.items()
        if group is not None and group not in OPTIONAL_GROUPS
    }
    groups["slo"] = {
        "type": "object",
        "description": GROUPS["slo"],
        "x-kubernetes-validations": [{"rule": SLO_RULE[0], "message": SLO_RULE[1]}],
        "properties": {},
    }
    root: dict[str, Any] = {
        "type": "object",
        "description": GROUPS[None],
        "required": ["maxReplicas"],
        "x-kubernetes-validations": [
            {
                "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
                "message": "autoscaling.minReplicas must be less than or equal to autoscaling.maxReplicas",
            }
        ],
        "properties": {},
    }
    for _, knob_, default, integer in knobs():
        target = root if knob_.group is None else groups[knob_.group]
        target["properties"][knob_.key] = _knob_schema(knob_, default, integer)
    for group, node in groups.items():
        root["properties"][group] = node
    return root
