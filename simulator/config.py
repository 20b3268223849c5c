"""SIM.yaml: every key optional, each with the documented default.

autoscaling:          # the LLMDeployment's spec.autoscaling block, same field names
  minReplicas: 1
  maxReplicas: 8
  targets: {kvCacheUsage: 0.8, queuePerReplica: 4}
profile: h100-llama3-8b   # a shipped profile (h100-llama3-8b, h100-llama3-70b-tp4, ...: docs/simulator.md) or a JSON file
coldStartSeconds: 90      # pod creation to Ready; default: the profile's
slo: {timeToFirstTokenSeconds: 1.0, interTokenLatencySeconds: 0.1, attainment: 0.99}
                      # spec.autoscaling.slo's keys; what the results are judged on, and what
                      # Kvasir's autoscaler holds unless autoscaling.slo says otherwise
baselines: {concurrencyTarget: 32, kvTarget: 0.8, queueTarget: 4}
prefixCaching: true
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvasir.operator.api.source import SpecError
from kvasir.operator.autoscaler.decide import DEFAULT_TIME_TO_READY
from kvasir.operator.autoscaler.policy import Policy, parse_policy
from kvasir.operator.yaml_input import InputError, decode, load_documents, read_input
from kvasir.simulator.cluster import ClusterConfig, Slo
from kvasir.simulator.policies import Baselines
from kvasir.simulator.profile import ReplicaProfile, load_profile

DEFAULT_AUTOSCALING = {"minReplicas": 1, "maxReplicas": 8}
KEYS = {"autoscaling", "profile", "coldStartSeconds", "slo", "baselines", "prefixCaching"}


@dataclass(frozen=True)
class SimConfig:
    autoscaling: Policy
    profile: ReplicaProfile
    cold_start_s: float
    slo: Slo
    baselines: Baselines
    prefix_caching: bool

    @property
    def cluster(self) -> ClusterConfig:
        a = self.autoscaling
        # The longest any policy remembers: its windows, the HPA's 300 s, and decide()'s load
        # trend over 1.5 times the time to ready.
        memory = max(
            a.metrics_window_seconds,
            a.scale_up_stabilization_seconds,
            a.scale_down_stabilization_seconds,
            a.panic_hold_seconds,
            a.scale_down_period_seconds,
            300.0,
            1.5 * max(self.cold_start_s, DEFAULT_TIME_TO_READY),
            a.idle_seconds if a.min_replicas == 0 else 0.0,  # scale to zero waits this long
        )
        return ClusterConfig(
            profile=self.profile,
            min_replicas=self.autoscaling.min_replicas,
            max_replicas=self.autoscaling.max_replicas,
            interval_s=self.autoscaling.interval_seconds,
            metrics_window_s=self.autoscaling.metrics_window_seconds,
            cold_start_s=self.cold_start_s,
            slo=self.slo,
            prefix_caching=self.prefix_caching,
            rest_s=2 * memory,
            hold_s=self.autoscaling.hold_seconds,
            max_held=self.autoscaling.max_held,
        )

    @property
    def policy(self) -> Policy:
        return self.autoscaling


def _number(section: Mapping[str, Any], key: str, default: float, where: str = "") -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{where + '.' if where else ''}{key}: must be a non-negative number, got {value!r}")
    return float(value)


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: must be a mapping, got {value!r}")
    return value


SLO_DEFAULTS = {"timeToFirstTokenSeconds": 1.0, "interTokenLatencySeconds": 0.1, "attainment": 0.99}
RENAMED = {"ttftSeconds": "timeToFirstTokenSeconds", "itlSeconds": "interTokenLatencySeconds"}


def _slo(section: Mapping[str, Any]) -> Slo:
    """SIM.yaml's `slo`: spec.autoscaling.slo's keys and ranges (checked by its declaration), with
    the defaults above for what it leaves out (a simulation judges both latencies)."""
    for key in section:
        if key in RENAMED:
            raise ValueError(f"slo.{key}: renamed {RENAMED[key]} (the key of spec.autoscaling.slo)")
        if key not in SLO_DEFAULTS:
            raise ValueError(f"slo.{key}: unknown key; known: {', '.join(SLO_DEFAULTS)}")
    values = {**SLO_DEFAULTS, **{k: v for k, v in section.items() if v is not None}}
    try:
        declared = parse_policy({"maxReplicas": 1, "slo": values}).slo
    except SpecError as exc:
        raise ValueError(str(exc).replace("spec.autoscaling.", "")) from None
    assert declared is not None and declared.ttft_seconds is not None and declared.itl_seconds is not None
    return Slo(ttft_s=declared.ttft_seconds, itl_s=declared.itl_seconds, attainment=declared.attainment)


def parse_config(data: Mapping[str, Any] | None) -> SimConfig:
    """SIM.yaml's content; ValueError naming the key for anything wrong (the profile's file too)."""
    data = dict(data or {})
    unknown = [key for key in data if key not in KEYS]
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key; known: {', '.join(sorted(KEYS))}")
    slo = _slo(_section(data, "slo"))
    section = dict(_section(data, "autoscaling"))
    section.setdefault(
        "slo",
        {
            "timeToFirstTokenSeconds": slo.ttft_s,
            "interTokenLatencySeconds": slo.itl_s,
            "attainment": slo.attainment,
        },
    )
    try:
        autoscaling = parse_policy({**DEFAULT_AUTOSCALING, **section})
    except SpecError as exc:
        raise ValueError(str(exc).replace("spec.autoscaling", "autoscaling")) from None
    try:
        profile = load_profile(str(data.get("profile", "h100-llama3-8b")))
    except ValueError as exc:
        raise ValueError(f"profile: {exc}") from None
    baselines = _section(data, "baselines")
    prefix_caching = data.get("prefixCaching", True)
    if not isinstance(prefix_caching, bool):
        raise ValueError(f"prefixCaching: must be true or false, got {prefix_caching!r}")
    default_baselines = Baselines()
    return SimConfig(
        autoscaling=autoscaling,
        profile=profile,
        cold_start_s=_number(data, "coldStartSeconds", profile.cold_start_s),
        slo=slo,
        baselines=Baselines(
            concurrency_target=_number(
                baselines, "concurrencyTarget", default_baselines.concurrency_target, "baselines"
            ),
            kv_target=_number(baselines, "kvTarget", default_baselines.kv_target, "baselines"),
            queue_target=_number(baselines, "queueTarget", default_baselines.queue_target, "baselines"),
        ),
        prefix_caching=prefix_caching,
    )


def load_config(path: str | Path | None) -> SimConfig:
    """SIM.yaml from a file (None: every default); InputError or ValueError naming the line or key
    (not the file: the caller names it)."""
    if path is None:
        return parse_config({})
    documents = load_documents(decode(read_input(path)))
    if len(documents) > 1:
        raise InputError("expected one YAML document, found several", documents[1].line)
    data = documents[0].value if documents else None
    if data is not None and not isinstance(data, Mapping):
        raise InputError("expected a mapping of the keys below at the top", documents[0].line)
    try:
        return parse_config(data)
    except ValueError as exc:
        # Messages start with the key they are about ("slo.timeToFirstTokenSeconds: ..."): find its line.
        key = str(exc).split(": ", 1)[0]
        line = documents[0].line_of(key) if documents and " " not in key else None
        raise InputError(str(exc), line) from None
