"""What decide() reads about the pods and remembers between ticks: hand-off types in a module of
their own, so that every rule module can name them without importing decide() (the autoscaler's
modules import one way only: tests/operator/autoscaler/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvasir.operator.autoscaler import budget, headroom, knee, learned

DEFAULT_TIME_TO_READY = 120.0  # seconds, until the deployment's own pods have been measured


@dataclass(frozen=True)
class ReplicaState:
    """Where the deployment's pods are."""

    current: int  # spec.replicas: what is asked for now
    ready: int
    starting: int = 0  # created, not ready yet, and not stuck: capacity on the way
    stuck: int = 0  # not ready long past the time-to-ready: not counted as capacity
    time_to_ready_seconds: float | None = None  # measured on this deployment's pods
    # The most requests one pod runs at once (spec.runtime.maxNumSeqs, which the operator sets):
    # a limit of the replica's batch, where its latency turns into a queue (knee.py).
    max_running: int | None = None


@dataclass(frozen=True)
class DecisionRecord:
    time: float
    replicas_from: int
    replicas_to: int
    reason: str


@dataclass(frozen=True)
class History:
    """What decide() remembers between ticks (returned anew by every decision)."""

    recommendations: tuple[tuple[float, int], ...] = ()  # (time, recommended replicas)
    load: tuple[tuple[float, float], ...] = ()  # (time, KV usage x serving replicas): the trend
    last_scale_up: float | None = None
    last_scale_down: float | None = None
    panic_until: float | None = None
    decisions: tuple[DecisionRecord, ...] = ()
    # What decide() learns (learned.py): the tail ratio at rest, the SLO pressure (observed
    # percentile / objective) of each tick, and when scale-up episodes started.
    ratios: learned.Readings = ()
    pressures: tuple[learned.Points, learned.Points] = ((), ())  # TTFT's, time per token's
    episodes: tuple[float, ...] = ()
    # With an SLO: each tick's requests over an objective (the error budget's burn), and its
    # arrival rate with the replicas that served it (the learned capacity and headroom).
    burns: budget.Burns = ()
    demand: headroom.Demand = ()
    # With an SLO: each unqueued tick's arrivals and running requests per replica (the knee).
    running: knee.Readings = ()

    @staticmethod
    def starting_at(now: float, replicas: int) -> History:
        """After a restart: behave as if `replicas` had been recommended for the whole window, so
        an operator restart never causes a scale-down before a full stabilization window."""
        return History(recommendations=((now, replicas),))
