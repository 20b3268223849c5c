"""SIM.yaml: every key optional, each with the documented default.

autoscaling:          # the LLMDeployment's spec.autoscaling block, same field names
  minReplicas: 1
  maxReplicas: 8
  targets: {kvCacheUsage: 0.8, queuePerReplica: 4, latencyRatio: 5}
profile: h100-llama3-8b   # a shipped profile (h100-llama3-8b, cpu-embedded) or a JSON file
coldStartSeconds: 90      # pod creation to Ready; default: the profile's
slo: {ttftSeconds: 1.0, itlSeconds: 0.1, attainment: 0.99}
baselines: {concurrencyTarget: 32, kvTarget: 0.8, queueTarget: 4}
prefixCaching: true
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvasir.operator.autoscaler.loop import policy_for
from kvasir.operator.source import SpecError
from kvasir.operator.spec import AutoscalingSpec, parse_autoscaling
from kvasir.simulator.cluster import ClusterConfig, Slo
from kvasir.simulator.policies import Baselines
from kvasir.simulator.profile import ReplicaProfile, load_profile

DEFAULT_AUTOSCALING = {"minReplicas": 1, "maxReplicas": 8}
KEYS = {"autoscaling", "profile", "coldStartSeconds", "slo", "baselines", "prefixCaching"}


@dataclass(frozen=True)
class SimConfig:
    autoscaling: AutoscalingSpec
    profile: ReplicaProfile
    cold_start_s: float
    slo: Slo
    baselines: Baselines
    prefix_caching: bool

    @property
    def cluster(self) -> ClusterConfig:
        return ClusterConfig(
            profile=self.profile,
            min_replicas=self.autoscaling.min_replicas,
            max_replicas=self.autoscaling.max_replicas,
            interval_s=self.autoscaling.interval_seconds,
            metrics_window_s=self.autoscaling.metrics_window_seconds,
            cold_start_s=self.cold_start_s,
            slo=self.slo,
            prefix_caching=self.prefix_caching,
        )

    @property
    def policy(self) -> Any:
        return policy_for(self.autoscaling)


def _number(section: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{where}.{key}: must be a non-negative number, got {value!r}")
    return float(value)


def parse_config(data: Mapping[str, Any] | None) -> SimConfig:
    data = dict(data or {})
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(KEYS))}")
    try:
        autoscaling = parse_autoscaling({**DEFAULT_AUTOSCALING, **(data.get("autoscaling") or {})})
    except SpecError as exc:
        raise ValueError(str(exc).replace("spec.autoscaling", "autoscaling")) from None
    profile = load_profile(str(data.get("profile", "h100-llama3-8b")))
    slo = data.get("slo") or {}
    baselines = data.get("baselines") or {}
    default_baselines = Baselines()
    return SimConfig(
        autoscaling=autoscaling,
        profile=profile,
        cold_start_s=_number(data, "coldStartSeconds", profile.cold_start_s, "config"),
        slo=Slo(
            ttft_s=_number(slo, "ttftSeconds", 1.0, "slo"),
            itl_s=_number(slo, "itlSeconds", 0.1, "slo"),
            attainment=_number(slo, "attainment", 0.99, "slo"),
        ),
        baselines=Baselines(
            concurrency_target=_number(
                baselines, "concurrencyTarget", default_baselines.concurrency_target, "baselines"
            ),
            kv_target=_number(baselines, "kvTarget", default_baselines.kv_target, "baselines"),
            queue_target=_number(baselines, "queueTarget", default_baselines.queue_target, "baselines"),
        ),
        prefix_caching=bool(data.get("prefixCaching", True)),
    )


def load_config(path: str | Path | None) -> SimConfig:
    if path is None:
        return parse_config({})
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if data is not None and not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping at the top")
    return parse_config(data)
