"""What decide() learns about one deployment from its own history, as pure functions over the
readings `History` keeps (bounded: the last hour or two, at most a few hundred points):

- its tail shape at rest: the P99/P50 latency ratio it shows while unsaturated. Mixed prompt
  lengths, or prefills interleaved with decodes, make the ratio high at any load; only a rise
  above the deployment's own baseline says that requests have started to wait on each other.
- its latency floor: the lowest SLO pressure (observed percentile / objective, smoothed over a
  few ticks) seen at rest in the last hour: the part of latency that no replica count removes
  (a long prompt's prefill, or the bucket a coarse histogram rounds a percentile up to).
  Projections onto another replica count scale only the part above it.
- how often its peaks recur: scale-up episodes that come back at a steady interval (bursts, a
  multi-peak day) keep their capacity for a little longer than that interval, so the next peak
  finds it still there instead of paying a cold start again.
- whether a series grows (`trend`): a least-squares slope, kept only where it stands clear of the
  noise; the KV demand's (targets.py) and the arrivals' (headroom.py)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

MEMORY_SECONDS = 3600.0  # how far back the baselines look
MAX_READINGS = 240  # per baseline: one an interval over an hour at the default 15 s
MIN_READINGS = 8  # a baseline needs this many readings (two minutes at the default interval)
TAIL_RISE = 1.5  # a tail ratio this many times the baseline is a rise, not the workload
RECURRENCE_HOLD = 1.25  # capacity is held this many recurrence intervals after a peak
MAX_HOLD_SECONDS = 3600.0

SMOOTHING = 3  # SLO pressures are read as the median of this many ticks

Readings = tuple[tuple[float, float], ...]
# (time, raw, smoothed, at rest 1/0, raw floor, smoothed floor; a floor of -1: not shown)
Points = tuple[tuple[float, float, float, float, float, float], ...]


def remember(readings: Readings, now: float, value: float | None) -> Readings:
    """`readings` with (now, value) appended (when known), trimmed to the memory."""
    kept = tuple((t, v) for t, v in readings if t > now - MEMORY_SECONDS)
    if value is not None:
        kept = (*kept, (now, value))
    return kept[-MAX_READINGS:]


def tail_baseline(readings: Readings) -> float | None:
    """The deployment's P99/P50 ratio at rest: the median of its unsaturated readings."""
    if len(readings) < MIN_READINGS:
        return None
    return statistics.median(v for _, v in readings)


def tail_threshold(readings: Readings, floor: float) -> float:
    """The ratio above which the tail has risen: `floor` (latencyRatio), or TAIL_RISE times the
    learned baseline where that is higher."""
    baseline = tail_baseline(readings)
    return floor if baseline is None else max(floor, TAIL_RISE * baseline)


def remember_point(
    points: Points, now: float, value: float | None, floor: float | None, at_rest: bool
) -> Points:
    """`points` with this tick's pressure appended (when known) as (time, raw, smoothed, at rest,
    raw floor, smoothed floor), trimmed to the memory. Smoothed is the median of the last
    SMOOTHING raw readings: a window's P99 of a hundred requests is nearly their maximum, and one
    long prompt moves it. `floor` is the part of this tick's pressure the window shows to be
    independent of the load (None: not shown)."""
    kept = tuple(p for p in points if p[0] > now - MEMORY_SECONDS)
    if value is None:
        return kept
    recent = kept[-(SMOOTHING - 1) :]
    smoothed = statistics.median([p[1] for p in recent] + [value])
    floors = [p[4] for p in recent if p[4] >= 0] + ([] if floor is None else [floor])
    smoothed_floor = statistics.median(floors) if floor is not None else -1.0
    point = (now, value, smoothed, 1.0 if at_rest else 0.0, -1.0 if floor is None else floor, smoothed_floor)
    return (*kept, point)[-MAX_READINGS:]


def latency_floor(points: Points) -> float | None:
    """The part of an SLO pressure that no replica count removes: the lowest smoothed reading
    taken at rest (no queue, nothing preempted) in the memory; None until MIN_READINGS such.
    Readings under overload are never at rest, so overload is never taken for a floor."""
    rest = [p[2] for p in points if p[3]]
    return min(rest) if len(rest) >= MIN_READINGS else None


def new_episode(episodes: tuple[float, ...], now: float, gap: float) -> tuple[float, ...]:
    """`episodes` (start times of scale-up episodes) after a scale-up at `now`: a new episode
    unless the last one started within `gap` seconds."""
    if episodes and now - episodes[-1] < gap:
        return episodes
    kept = tuple(t for t in episodes if t > now - 2 * MAX_HOLD_SECONDS)
    return (*kept, now)[-16:]


def hold_seconds(episodes: Sequence[float], now: float, window: float) -> float:
    """The scale-down window: `window`, or longer while peaks recur. Recurrence is the median gap
    between the last episodes, when two gaps or more agree within a quarter of it (noise makes
    irregular episodes, bursts and a multi-peak day regular ones); the hold lasts RECURRENCE_HOLD
    of it, and only while the pattern is live (the last episode within two recurrences)."""
    if len(episodes) < 3:
        return window
    gaps = [b - a for a, b in itertools.pairwise(episodes)][-4:]
    recurrence = statistics.median(gaps)
    if max(gaps) - min(gaps) > 0.25 * recurrence or now - episodes[-1] > 2 * recurrence:
        return window
    return max(window, min(MAX_HOLD_SECONDS, RECURRENCE_HOLD * recurrence))


def trend(load: tuple[tuple[float, float], ...]) -> float:
    """Growth per second of the KV demand, if the samples show a real trend, else 0.

    Least squares over the remembered samples, kept only when the slope stands well clear of the
    noise (t-statistic above 5): a jittery but steady load never looks like growth."""
    if len(load) < 8:
        return 0.0
    times = [t for t, _ in load]
    values = [v for _, v in load]
    n = len(load)
    mean_t, mean_v = sum(times) / n, sum(values) / n
    spread = sum((t - mean_t) ** 2 for t in times)
    if spread == 0:
        return 0.0
    slope = sum((t - mean_t) * (v - mean_v) for t, v in load) / spread
    residual = sum((v - mean_v - slope * (t - mean_t)) ** 2 for t, v in load) / (n - 2)
    error = math.sqrt(residual / spread) if residual > 0 else 0.0
    if slope <= 0 or (error > 0 and slope / error < 5.0):
        return 0.0
    return slope
