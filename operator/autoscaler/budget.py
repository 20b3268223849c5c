"""The SLO's error budget as decide() spends it: of the requests in a window, how many missed an
objective, against the 1 - attainment that may (the burn rate, as SRE alerting reads an SLO).

A window's P99 of a hundred or two requests is nearly their maximum: one long prompt stalling a
replica's decodes lifts it over the objective while 99.5% of requests still meet it. Latency
above the aim scales up only while the budget actually burns: faster than it may in the last
window and over BURN_SECONDS (a sustained miss), or FAST_BURN times faster in the last window
alone (a load that jumped). Both windows are read from the same histograms as the percentiles."""

from __future__ import annotations

from kvasir.operator.autoscaler.policy import Slo
from kvasir.operator.autoscaler.signals import Signals, histogram_count_above

BURN_SECONDS = 600.0  # the long window: ten minutes of ticks
FAST_BURN = 3.0  # a burn this many times the budget in the last window acts alone
# A burn this fast (a tenth of the requests missing at a 99% SLO) is a load that jumped, which no
# window's noise makes: latency may then step by half again even where the capacity is known.
JUMP_BURN = 10.0

# (time, requests over each objective (TTFT's, time per token's), requests) per tick, the
# window's counts.
Burns = tuple[tuple[float, tuple[float, float], float], ...]
BOTH = (0, 1)  # the latencies' slots: 0 TTFT, 1 time per output token (as History.pressures)


def missed(signals: Signals, slo: Slo) -> tuple[tuple[float, float], float] | None:
    """((requests over the TTFT objective, over the time-per-token objective), requests) in the
    window; None when no histogram is readable. Added, the two count at most the requests that
    missed either (a request that misses both counts twice, so the burn is never understated)."""
    over, total = [0.0, 0.0], 0.0
    for slot, objective, histogram in (
        (0, slo.ttft_seconds, signals.ttft_histogram),
        (1, slo.itl_seconds, signals.tpot_histogram),
    ):
        if objective is None or histogram is None:
            continue
        above = histogram_count_above(objective, histogram.buckets)
        if above is None:
            continue
        over[slot] = above
        total = max(total, histogram.count)
    return ((over[0], over[1]), total) if total > 0 else None


def remember(burns: Burns, now: float, reading: tuple[tuple[float, float], float] | None) -> Burns:
    kept = tuple(b for b in burns if b[0] > now - BURN_SECONDS)
    return kept if reading is None else (*kept, (now, *reading))


def burn_rates(
    burns: Burns, now: float, attainment: float, latencies: tuple[int, ...] = BOTH
) -> tuple[float, float] | None:
    """(last window's burn, BURN_SECONDS' burn): the share of requests over the objectives of
    `latencies` divided by the share allowed (1 - attainment); None without this tick's reading.
    The long one sums the ticks' windows (they overlap; each request is counted about as often as
    any other)."""
    if not burns or burns[-1][0] != now:
        return None
    allowed = 1.0 - attainment

    def over(counts: tuple[float, float]) -> float:
        return sum(counts[i] for i in latencies)

    _, counts, total = burns[-1]
    short = over(counts) / total / allowed
    recent = [b for b in burns if b[0] > now - BURN_SECONDS]
    long = sum(over(b[1]) for b in recent) / max(sum(b[2] for b in recent), 1e-9) / allowed
    return short, long


def burning(rates: tuple[float, float] | None) -> str:
    """Why the budget calls for more replicas ('' when it does not): a sustained or a fast burn."""
    if rates is None:
        return ""
    short, long = rates
    if short > FAST_BURN:
        return f"error budget burning {short:.1f}x"
    if short > 1.0 and long > 1.0:
        return f"error budget burning {short:.1f}x ({long:.1f}x over {BURN_SECONDS:.0f}s)"
    return ""
