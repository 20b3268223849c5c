"""Load traces: one JSON object per line, `{"arrival_time": s, "prompt_tokens": n, "output_tokens": m}`
with optional `"prefix_group"` and `"prefix_tokens"` (requests of one group share their first
`prefix_tokens` tokens, as a system prompt does). Generators for the shapes traffic takes:
steady Poisson, a step ramp, a flash crowd, bursts, a diurnal day, a shift to long prompts, and a
two-peak working day."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: str | None = None
    prefix_tokens: int = 0


# The longest line read: a request is a few fields (about 100 bytes).
MAX_LINE_BYTES = 64 * 1024


class TraceError(ValueError):
    """A trace line that is not a valid request; the message names the line and the field."""


def _parse(line_number: int, item: Any) -> TraceRequest:
    if not isinstance(item, dict):
        raise TraceError(f"line {line_number}: expected a JSON object")
    try:
        arrival = float(item["arrival_time"])
        prompt = int(item["prompt_tokens"])
        output = int(item["output_tokens"])
        prefix = int(item.get("prefix_tokens") or 0)
    except KeyError as exc:
        raise TraceError(f"line {line_number}: missing {exc.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError):
        raise TraceError(
            f"line {line_number}: arrival_time, prompt_tokens, output_tokens and prefix_tokens must be numbers"
        ) from None
    if not math.isfinite(arrival) or prompt < 1 or output < 1:
        raise TraceError(
            f"line {line_number}: needs a finite arrival_time and at least 1 prompt and 1 output token"
        )
    group = item.get("prefix_group")
    if not 0 <= prefix <= prompt:
        raise TraceError(f"line {line_number}: prefix_tokens must be between 0 and prompt_tokens")
    return TraceRequest(arrival, prompt, output, None if group is None else str(group), prefix)


@dataclass(frozen=True)
class Trace:
    """A trace read from a file: its requests (sorted, times relative to the first request) and
    where its largest gap between two requests is (a far-future line shows there)."""

    requests: list[TraceRequest]
    start: float  # the first request's arrival_time as written (a Unix time for recorded traces)
    gap: float  # the largest time between consecutive requests
    gap_line: int  # the line of the request after it


def read_trace(path: str | Path) -> Trace:
    """The requests of a JSONL trace; TraceError (naming the line, not the file) for a bad one.

    Arrival times may be relative or absolute (seconds since the Unix epoch, as recorded traces
    have them): the replay starts at the first request either way."""
    lines: list[tuple[int, TraceRequest]] = []
    with open(path, "rb") as handle:  # bytes, so that a bad byte is found on its own line
        # Lines are read one at a time, each at most MAX_LINE_BYTES: a trace may be long, a
        # request's line is short.
        for line_number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"line {line_number}: longer than {MAX_LINE_BYTES} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"line {line_number}: not UTF-8 text ({exc.reason})") from None
            if line.strip():
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"line {line_number}: not JSON ({exc.msg})") from None
                except RecursionError:
                    raise TraceError(f"line {line_number}: nested too deeply to be read") from None
                lines.append((line_number, _parse(line_number, item)))
    if not lines:
        raise TraceError("no requests")
    lines.sort(key=lambda pair: pair[1].arrival_time)
    start = lines[0][1].arrival_time
    gap, gap_line = 0.0, lines[0][0]
    for (_, before), (number, after) in itertools.pairwise(lines):
        if after.arrival_time - before.arrival_time > gap:
            gap, gap_line = after.arrival_time - before.arrival_time, number
    requests = [replace(r, arrival_time=r.arrival_time - start) if start else r for _, r in lines]
    return Trace(requests, start, gap, gap_line)


def write_trace(requests: Iterable[TraceRequest], out: IO[str]) -> int:
    count = 0
    for r in requests:
        item: dict[str, Any] = {
            "arrival_time": round(r.arrival_time, 6),
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
        }
        if r.prefix_group is not None:
            item["prefix_group"] = r.prefix_group
            item["prefix_tokens"] = r.prefix_tokens
        out.write(json.dumps(item) + "\n")
        count += 1
    return count


# ---- generators ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lengths:
    """Prompt and output lengths: log-normal around a median, clipped (chat traffic looks so)."""

    prompt_median: int = 512
    output_median: int = 256
    sigma: float = 0.6
    max_prompt: int = 4096
    max_output: int = 1024

    def draw(self, rng: random.Random, prompt_scale: float = 1.0) -> tuple[int, int]:
        prompt = int(
            min(
                self.max_prompt * prompt_scale,
                max(8, rng.lognormvariate(math.log(self.prompt_median * prompt_scale), self.sigma)),
            )
        )
        output = int(
            min(self.max_output, max(4, rng.lognormvariate(math.log(self.output_median), self.sigma)))
        )
        return prompt, output


Rate = Callable[[float], float]  # requests per second at time t


def _arrivals(rate: Rate, peak: float, duration: float, rng: random.Random) -> Iterator[float]:
    """A non-homogeneous Poisson process by thinning (Lewis and Shedler)."""
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return
        if rng.random() * peak <= rate(t):
            yield t


def generate(
    kind: str,
    *,
    duration: float,
    rate: float,
    seed: int = 0,
    lengths: Lengths = Lengths(),
    prefix_groups: int = 0,
    prefix_tokens: int = 0,
) -> list[TraceRequest]:
    """A trace of one of the shipped shapes; `rate` is the base (or mean) requests per second."""
    rng = random.Random(seed)
    shapes: dict[str, tuple[Rate, float]] = {
        "poisson": (lambda t: rate, rate),
        # Four equal steps from rate to 4x rate.
        "ramp": (lambda t: rate * (1 + math.floor(4 * t / duration)), 4 * rate),
        # 10x the rate within 30 s, from a third of the way, for a fifth of the trace.
        "flash-crowd": (lambda t: rate * _flash(t, duration), 10 * rate),
        # 5x bursts of 60 s every 10 minutes.
        "bursts": (lambda t: rate * (5.0 if (t % 600) < 60 else 1.0), 5 * rate),
        # One day: a trough at 4 am, a peak at 4 pm of 5x the trough; `rate` is the mean.
        "diurnal": (lambda t: rate * _diurnal(t, duration), 5 * rate / 3.0),
        # Constant request rate; from the middle on, prompts are 8x longer.
        "long-prompts": (lambda t: rate, rate),
        # A working day with two peaks (late morning, mid afternoon) of 20x the night's `rate`.
        "two-peak": (lambda t: rate * _two_peaks(t, duration), 20 * rate),
    }
    if kind not in shapes:
        raise ValueError(f"unknown trace kind {kind!r}; one of {', '.join(shapes)}")
    shape, peak = shapes[kind]
    out = []
    for t in _arrivals(shape, peak, duration, rng):
        scale = 8.0 if kind == "long-prompts" and t >= duration / 2 else 1.0
        prompt, output = lengths.draw(rng, scale)
        group = None
        prefix = 0
        if prefix_groups:
            group = f"g{rng.randrange(prefix_groups)}"
            prefix = min(prefix_tokens, prompt - 1)
        out.append(TraceRequest(t, prompt, output, group, prefix))
    return out


def _flash(t: float, duration: float) -> float:
    start, rise, length = duration / 3, 30.0, duration / 5
    if t < start or t > start + length:
        return 1.0
    return 1.0 + 9.0 * min(1.0, (t - start) / rise)


def _two_peaks(t: float, duration: float) -> float:
    """1 at night, 20 at each of two peaks (at 30% and 70% of the trace, each about a tenth of it
    wide), so the rate swings 20x twice: a capacity planner's two-hump day."""
    x = t / duration
    bump = max(math.exp(-(((x - 0.3) / 0.08) ** 2)), math.exp(-(((x - 0.7) / 0.08) ** 2)))
    return 1.0 + 19.0 * bump


def _diurnal(t: float, duration: float) -> float:
    """Mean 1; 1/3 at the trough and 5/3 at the peak (a 5x swing), one cycle per `duration`."""
    phase = 2 * math.pi * (t / duration - 10 / 24)  # the peak at 16:00 on a 24 h clock
    return 1.0 + (2.0 / 3.0) * math.sin(phase)


KINDS = ("poisson", "ramp", "flash-crowd", "bursts", "diurnal", "long-prompts", "two-peak")
