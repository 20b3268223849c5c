"""Headroom learned from the arrivals: how many requests a second one replica has served inside
the SLO (the deployment's own capacity, learned from its good ticks), and the demand to stay
ready for. Arrivals whose spread around their trend over the last HEADROOM_SECONDS is no more
than Poisson noise (a steady load, a day's slow curve) are ready for the trend's value now;
arrivals spread well beyond it (the index of dispersion above DISPERSION: bursts, a crowd) are
ready for the highest rate of the lookback, the recent peak. A scale-down never goes below the
replicas that demand needs at that capacity: bursts that recur within the lookback find their
replicas still there, which a reactive scale-up cannot give them (a burst shorter than a cold
start plus a metrics window is over before new replicas could serve it)."""

from __future__ import annotations

import math
import statistics

from kvasir.operator.autoscaler.learned import MEMORY_SECONDS, MIN_READINGS, trend

HEADROOM_SECONDS = 1200.0  # the lookback: longer than bursts take to come back
# Arrivals are bursty only when their spread is this many times a Poisson process's (the index
# of dispersion); below it, the spread is the estimate's own noise and holds nothing.
DISPERSION = 2.0
# A peak is held only if it was a burst: no longer than this many reaction times (cold start,
# metrics window, tick), the part a scale-up arriving after it could not have served.
BURST_REACTIONS = 2.0
MIN_RATE_READINGS = 8
# Arrivals are a burst (passing_burst) only at this many times their usual level: a steady load's
# noise, or a day's slow swing, is not one.
BURST_HEIGHT = 2.0

# A good tick's load per replica, projected to the aim, counts at most this many times what was
# seen: a replica never pushed near its limit is not credited with more than a tenth again.
MAX_STRETCH = 1.1
# A rate counted over a window is Poisson-noisy: the capacity takes each good tick's rate this
# many standard deviations low, so that the highest of a hundred readings is not their luckiest.
NOISE_SIGMAS = 2.0

# (time, arrivals per second, serving replicas, stretch, the rate's lower bound): stretch 0 for a
# tick that did not meet the SLO; else how much more load per replica its latencies would take to
# reach their aim.
Reading = tuple[float, float, float, float, float]
Demand = tuple[Reading, ...]


def remember(
    demand: Demand, now: float, rate: float | None, serving: int, stretch: float, window_seconds: float
) -> Demand:
    kept = tuple(d for d in demand if d[0] > now - MEMORY_SECONDS)
    if rate is None or serving <= 0:
        return kept
    return (*kept, (now, rate, float(serving), stretch, _low(rate, window_seconds)))


def _low(rate: float, window_seconds: float) -> float:
    """`rate` taken NOISE_SIGMAS low: a rate counted over `window_seconds` from a Poisson process
    has a variance of rate / window_seconds."""
    return max(0.0, rate - NOISE_SIGMAS * math.sqrt(rate / max(window_seconds, 1.0)))


def capacity(demand: Demand) -> float | None:
    """Requests per second one replica serves inside the SLO: the most a good tick of the memory
    served (its rate's lower bound), or would have by the latency projection (its stretch); None
    until MIN_READINGS good ticks."""
    good = [low / serving * stretch for _, _, serving, stretch, low in demand if stretch > 0]
    return max(good) if len(good) >= MIN_READINGS else None


def envelope(demand: Demand, now: float, window_seconds: float, reaction_seconds: float) -> float | None:
    """The arrival rate to be ready for (_envelope)."""
    read = _envelope(demand, now, window_seconds, reaction_seconds)
    return None if read is None else read[0]


def _envelope(
    demand: Demand, now: float, window_seconds: float, reaction_seconds: float
) -> tuple[float, bool] | None:
    """(the arrival rate to be ready for, whether it is a burst's peak held): the least-squares
    trend's value now, or the lookback's peak when the spread around the trend is well beyond Poisson noise (a rate counted over
    `window_seconds` from a Poisson process of rate r has a variance of r / window_seconds) and
    the peak was a burst: above half its height over the lookback's lowest reading for no longer
    than BURST_REACTIONS times
    `reaction_seconds` (a cold start, a window and a tick). A longer peak is a level the
    deployment can scale for when it comes (a crowd, a working day's peak): after one, the
    current level (the last window's readings), not the trend it bent."""
    recent = [(t, d[1]) for d in demand if (t := d[0]) > now - HEADROOM_SECONDS]
    if len(recent) < MIN_RATE_READINGS:
        return None
    times = [t for t, _ in recent]
    rates = [r for _, r in recent]
    mean_t, mean_r = statistics.fmean(times), statistics.fmean(rates)
    spread_t = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in recent) / spread_t if spread_t else 0.0
    residual = [r - mean_r - slope * (t - mean_t) for t, r in recent]
    variance = sum(e * e for e in residual) / max(len(recent) - 2, 1)
    trend = max(0.0, mean_r + slope * (now - mean_t))
    if variance <= DISPERSION * mean_r / max(window_seconds, 1.0):
        return trend, False
    peak = max(rates)
    # A peak's height is measured from the lookback's lowest reading, the level it rose from (a
    # trend fitted through a hump runs half way up it and would make the hump look narrow).
    if _peak_seconds(recent, peak, min(rates)) <= BURST_REACTIONS * reaction_seconds:
        return max(trend, peak), peak > trend
    return statistics.fmean(r for t, r in recent if t > now - window_seconds), False


def _peak_seconds(readings: list[tuple[float, float]], peak: float, base: float) -> float:
    """How long the run of readings around the highest stayed above half its height over
    `base`."""
    half = base + (peak - base) / 2
    top = max(range(len(readings)), key=lambda i: readings[i][1])
    first = last = top
    while first > 0 and readings[first - 1][1] > half:
        first -= 1
    while last < len(readings) - 1 and readings[last + 1][1] > half:
        last += 1
    return readings[last][0] - readings[first][0]


def replicas_needed(
    demand: Demand, now: float, window_seconds: float, reaction_seconds: float
) -> tuple[int, str, bool] | None:
    """The replicas the demand envelope needs at the learned capacity, why, and whether the
    envelope is a burst's peak held; None until both are known."""
    per_replica = capacity(demand)
    read = _envelope(demand, now, window_seconds, reaction_seconds)
    if per_replica is None or read is None or per_replica <= 0:
        return None
    wanted, held_peak = read
    count = max(1, math.ceil(wanted / per_replica - 1e-9))
    what = "a recent burst's peak" if held_peak else "arrivals to be ready for"
    return count, f"{what} {wanted:.2f}/s at {per_replica:.3g}/s per replica -> {count}", held_peak


def passing_burst(
    demand: Demand, now: float, rate: float, serving: int, horizon: float, window_seconds: float
) -> str | None:
    """Why arrivals at `rate` are a burst that will be over before a pod started now serves, the
    forecast from precedent (None when the memory does not show it): the rate stands at least
    BURST_HEIGHT times the memory's usual level (its median); every earlier run of arrivals at
    least half way from that level up to `rate` was over within `horizon` on `serving` or fewer
    replicas, and one at least reached `rate` (its lower bound, as the capacity reads a rate: a
    rise that only flickered across the half-way mark on its way up is no precedent); and the
    present run is no longer than `horizon` yet. A replica
    asked for such a burst serves the valley after it. The first burst has no precedent: it is
    scaled for as any rise. Whether the bursts were served inside the SLO is the error budget's
    to say (the caller's)."""
    readings = [d for d in demand if d[0] > now - MEMORY_SECONDS]
    if len(readings) < MIN_RATE_READINGS:
        return None
    usual = statistics.median(d[1] for d in readings)
    if rate < BURST_HEIGHT * usual:
        return None
    level = usual + (rate - usual) / 2
    runs = _runs_above(readings, level)
    present = runs.pop() if runs and runs[-1][-1] is readings[-1] else []
    if not runs or _seconds(present) > horizon:
        return None
    if any(_seconds(run) > horizon or not _served_by(run, serving) for run in runs):
        return None
    height = _low(rate, window_seconds)
    if not any(max(r[1] for r in run) >= height for run in runs):
        return None
    longest = max(_seconds(run) for run in runs)
    return (
        f"a burst ({rate:.2f}/s, usually {usual:.2f}/s): {len(runs)} earlier in the hour, each over "
        f"within {longest:.0f}s on at most {serving} replica{'s' if serving > 1 else ''}"
    )


def _runs_above(readings: list[Reading], level: float) -> list[list[Reading]]:
    """The maximal runs of consecutive readings whose rate is above `level`, oldest first."""
    runs: list[list[Reading]] = []
    previous_above = False
    for reading in readings:
        above = reading[1] > level
        if above and previous_above:
            runs[-1].append(reading)
        elif above:
            runs.append([reading])
        previous_above = above
    return runs


def _seconds(run: list[Reading]) -> float:
    return run[-1][0] - run[0][0] if run else 0.0


def _served_by(run: list[Reading], serving: int) -> bool:
    """Every tick of `run` had at most `serving` replicas serving."""
    return all(replicas <= serving for _, _, replicas, _, _ in run)


def rising(demand: Demand, now: float, seconds: float = HEADROOM_SECONDS) -> float:
    """The arrivals' growth per second over the last `seconds` when it stands clear of the noise
    (the same test as the KV demand's trend: a least-squares slope with a t-statistic above 5),
    else 0. While arrivals rise, a scale-down only has to be undone."""
    return trend(tuple((t, d[1]) for d in demand if (t := d[0]) > now - seconds))


def falling(demand: Demand, now: float, seconds: float = HEADROOM_SECONDS) -> float:
    """The arrivals' fall per second over the last `seconds` when it stands clear of the noise
    (the test of rising(), on the rate turned upside down), else 0. While arrivals fall, the
    latency the window shows is that of a load already gone."""
    return trend(tuple((t, -d[1]) for d in demand if (t := d[0]) > now - seconds))


def replicas_for_rate(demand: Demand, rate: float | None, window_seconds: float) -> tuple[int, str] | None:
    """The replicas `rate` arrivals per second need at the learned capacity (the rate taken
    NOISE_SIGMAS low, as the capacity is: a lucky window asks for nothing); None until known. The
    capacity is a lower bound (the most one replica was seen to serve), so this count is
    enough, if not the fewest."""
    per_replica = capacity(demand)
    if per_replica is None or rate is None or per_replica <= 0:
        return None
    low = _low(rate, window_seconds)
    count = max(1, math.ceil(low / per_replica - 1e-9))
    return count, f"arrivals {rate:.2f}/s (at least {low:.2f}) at {per_replica:.3g}/s per replica -> {count}"
