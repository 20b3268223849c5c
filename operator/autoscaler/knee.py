"""Where one replica's latency turns from flat to a wall, learned from what its pods report.

A continuous-batching replica's latency stays flat while its running batch can still grow, then
turns into a queue within a tick once the batch hits a limit: the most requests it runs at once
(`--max-num-seqs`, which the operator sets) or a full KV cache. The learned capacity
(headroom.py) is what replicas were seen to serve, a lower bound that knows nothing of a knee
they never reached; with a long cold start, waiting for the knee to show in latency is too late.

The batch a load needs is predictable well before the limit. By Little's law a replica's running
requests R = x W (x: its arrivals per second, W: how long each runs). Each runs a fixed number of
steps K (its output tokens, its prefill chunks), and a step takes a + b R (more requests, a
longer step), so W = K (a + b R), and

    x / R = 1 / W = 1 / (K a) - (b / a) x

a straight line in x: the share of its requests a replica finishes per second falls linearly
with its load, and the running batch grows as x / (alpha - beta x), without bound at alpha /
beta. Both sides are exported by every pod (`kvasir_requests_running`, vLLM's
`vllm:num_requests_running`, and the arrivals from the TTFT histogram's count and the queue), so
the line is fitted on the deployment's own unqueued ticks, each counted for the running requests
it saw (fit()), and its knee is the arrival rate per replica at which the predicted batch reaches
the first limit. The slope must stand SLOPE_T standard errors clear of flat and is then taken
SLOPE_SIGMAS standard errors steeper (a knee is never placed further than the readings allow); a
line whose readings span too little load to show the slope, or whose busiest batch is far from
the limit (MIN_REACH), places no knee."""

from __future__ import annotations

import math
import statistics

from kvasir.operator.autoscaler.learned import MAX_READINGS, MEMORY_SECONDS, MIN_READINGS

# The slope places a knee only where it stands this many standard errors clear of flat (a
# replica seen only at light load shows no slope: its batch is noise around a constant W)...
SLOPE_T = 3.0
# ...and is then taken this many standard errors steeper than fitted: the knee errs early.
SLOPE_SIGMAS = 1.0
# The readings must span loads at least this far apart (the highest over the lowest rate per
# replica) before their slope places a knee: a replica seen at one load shows no slope.
MIN_SPAN = 1.5
# The line places a limit only once the busiest reading's batch has reached this share of it: a
# step's time is linear in the batch only as far as batches were seen, and a line through
# batches of a few requests says little about where a batch of hundreds stops (a replica whose
# latency binds long before its batch fills, a CPU replica's, never gets near it).
MIN_REACH = 0.25
# Arrivals are kept to this share of the knee (the batch at that rate is a fraction of the
# limit: a window's arrivals are noisy and the batch grows steeply near the limit).
KNEE_USE = 0.85

# (time, arrivals per second per replica, running requests per replica, KV usage per replica)
Readings = tuple[tuple[float, float, float, float], ...]


def remember(
    readings: Readings, now: float, rate: float | None, running: float | None, kv: float | None, serving: int
) -> Readings:
    """`readings` with this tick's per-replica load appended when it is readable (a tick with
    requests running and arriving; the caller passes None for a queued tick, whose running batch
    is capped rather than predicted), trimmed to the memory."""
    kept = tuple(r for r in readings if r[0] > now - MEMORY_SECONDS)
    if rate is None or running is None or serving <= 0 or rate <= 0 or running < 1:
        return kept
    return (*kept, (now, rate / serving, running / serving, (kv or 0.0)))[-MAX_READINGS:]


def fit(readings: Readings) -> tuple[float, float] | None:
    """(alpha, beta) of x / R = alpha - beta x, the slope taken SLOPE_SIGMAS standard errors
    steep and the line kept through the readings' weighted mean; None with too few readings or
    too narrow a span of load.

    Least squares with each reading weighted by its running requests R. A reading's x / R
    divides by a count: at light load a replica runs a few requests, and 1 / R of a small count
    is noisy and biased high (batches of 1 and 2 average 0.75 in 1 / R where their mean batch,
    1.5, gives 0.67), so a day's many light readings, counted alike, would steepen the line and
    place the knee early. Weighted by R, the fit at any one load is the ratio of sums (the arrivals of its
    readings over their running requests), whose bias falls with the requests counted, not with
    each reading's; every reading counts for the requests it saw."""
    if len(readings) < MIN_READINGS:
        return None
    xs = [r[1] for r in readings]
    if max(xs) < MIN_SPAN * min(xs):
        return None
    ys = [r[1] / r[2] for r in readings]
    weights = [r[2] for r in readings]
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    spread = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs, strict=True))
    if spread <= 0:
        return None
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys, strict=True)) / spread
    residual = sum(
        w * (y - mean_y - slope * (x - mean_x)) ** 2 for w, x, y in zip(weights, xs, ys, strict=True)
    )
    error = math.sqrt(residual / max(len(xs) - 2, 1) / spread)
    if slope >= 0 or -slope < SLOPE_T * error:
        return None
    beta = -slope + SLOPE_SIGMAS * error
    alpha = mean_y + beta * mean_x
    return (alpha, beta) if alpha > 0 else None


def running_at(alpha: float, beta: float, rate: float) -> float:
    """The running requests per replica the line predicts at `rate` arrivals per replica
    (infinite at or past saturation)."""
    left = alpha - beta * rate
    return rate / left if left > 0 else math.inf


def knee_rate(readings: Readings, max_running: int | None, target_kv: float) -> tuple[float, str] | None:
    """The arrivals per second one replica takes before its predicted batch reaches a limit: the
    most requests it runs at once (`max_running`, None: not known), or the requests the KV cache
    holds at `target_kv` (the readings' median KV usage per running request); and why. None
    until the line is fitted, without a limit, or before a batch of MIN_REACH of it was seen."""
    line = fit(readings)
    if line is None:
        return None
    alpha, beta = line
    limits = []
    if max_running is not None:
        limits.append((float(max_running), f"{max_running} running"))
    per_request = [r[3] / r[2] for r in readings if r[3] > 0]
    if per_request:
        held = target_kv / statistics.median(per_request)
        limits.append((held, f"KV {target_kv:g} at {held:.0f} running"))
    if not limits:
        return None
    limit, name = min(limits)
    if max(r[2] for r in readings) < MIN_REACH * limit:
        return None
    # R = x / (alpha - beta x) = limit  <=>  x = alpha limit / (1 + beta limit)
    rate = alpha * limit / (1 + beta * limit)
    return rate, f"knee {rate:.3g}/s per replica ({name})"


def replicas_below_knee(
    readings: Readings,
    max_running: int | None,
    target_kv: float,
    rate: float,
    latency_limit: float = math.inf,
) -> tuple[int, str] | None:
    """The replicas that keep `rate` arrivals per second at KNEE_USE of each replica's knee, and
    why; None until the knee is known, or where latency reaches its aim first (at
    `latency_limit` arrivals per second per replica: then latency is the replica's limit)."""
    knee = knee_rate(readings, max_running, target_kv)
    if knee is None or knee[0] <= 0 or knee[0] >= latency_limit:
        return None
    count = max(1, math.ceil(rate / (KNEE_USE * knee[0]) - 1e-9))
    return count, f"{rate:.2f}/s below {KNEE_USE:g} of the {knee[1]} -> {count}"
