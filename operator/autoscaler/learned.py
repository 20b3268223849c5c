"""What decide() learns about one deployment from its own history, as pure functions over the
readings `History` keeps (bounded: the last hour or two, at most a few hundred points):

- its tail shape at rest: the P99/P50 latency ratio it shows while unsaturated. Mixed prompt
  lengths, or prefills interleaved with decodes, make the ratio high at any load; only a rise
  above the deployment's own baseline says that requests have started to wait on each other.
- its latency floor: the lowest SLO pressure (observed percentile / objective) of the last hour,
  the part of latency that no replica count removes (a long prompt's prefill). Projections onto
  another replica count scale only the part above it.
- how often its peaks recur: scale-up episodes that come back at a steady interval (bursts, a
  multi-peak day) keep their capacity for a little longer than that interval, so the next peak
  finds it still there instead of paying a cold start again."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

MEMORY_SECONDS = 3600.0  # how far back the baselines look
MAX_READINGS = 240  # per baseline: one an interval over an hour at the default 15 s
MIN_READINGS = 8  # a baseline needs this many readings (two minutes at the default interval)
TAIL_RISE = 1.5  # a tail ratio this many times the baseline is a rise, not the workload
RECURRENCE_HOLD = 1.25  # capacity is held this many recurrence intervals after a peak
MAX_HOLD_SECONDS = 3600.0

Readings = tuple[tuple[float, float], ...]


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


def latency_floor(readings: Readings) -> float:
    """The lowest SLO pressure of the remembered readings (0 until there are enough): the part of
    latency that does not depend on the load. Underestimating it only makes projections cautious."""
    if len(readings) < MIN_READINGS:
        return 0.0
    return min(v for _, v in readings)


def new_episode(episodes: tuple[float, ...], now: float, gap: float) -> tuple[float, ...]:
    """`episodes` (start times of scale-up episodes) after a scale-up at `now`: a new episode
    unless the last one started within `gap` seconds."""
    if episodes and now - episodes[-1] < gap:
        return episodes
    kept = tuple(t for t in episodes if t > now - 2 * MAX_HOLD_SECONDS)
    return (*kept, now)[-16:]


def hold_seconds(episodes: Sequence[float], now: float, window: float) -> float:
    """The scale-down window: `window`, or longer while peaks recur. The recurrence is the median
    gap between the last episodes (two gaps or more); the hold lasts RECURRENCE_HOLD of it, and
    only while the pattern is live (the last episode within two recurrences)."""
    if len(episodes) < 3:
        return window
    gaps = [b - a for a, b in itertools.pairwise(episodes)][-4:]
    recurrence = statistics.median(gaps)
    if now - episodes[-1] > 2 * recurrence:
        return window
    return max(window, min(MAX_HOLD_SECONDS, RECURRENCE_HOLD * recurrence))
