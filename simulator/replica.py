"""One simulated replica: Kvasir's real `Scheduler` and `KVCacheManager` (they import no torch)
driven by a step-time model instead of a model. Every scheduling decision, chunked prefill,
preemption and prefix-cache hit is the real engine's; only the duration of a step is modelled.

Speed: a replica in steady decode (nothing waiting, every running request one token behind, no
request finishing, enough free blocks) does the same thing step after step, so up to the next
external event those steps are applied at once (`_fast_forward`): the same block allocations,
token counts and per-step durations as stepping one by one, without the per-step Python. Anything
else (an admission, a prefill chunk, a preemption, a finish) goes through the real scheduler."""

from __future__ import annotations

import math
import zlib
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from kvasir.observability.metric_names import ITL_BUCKETS, QUEUE_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from kvasir.operator.autoscaler.metrics import Histogram, PodMetrics
from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request
from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvasir.runtime.sample.params import SamplingParams
from kvasir.simulator.latency import LogHistogram
from kvasir.simulator.profile import ReplicaProfile
from kvasir.simulator.trace import TraceRequest

_PARAMS = SamplingParams(max_tokens=None, ignore_eos=True)
_TOKEN = 7  # every generated token; values only matter to prefix-cache hashes


@dataclass(frozen=True, slots=True)
class Finished:
    """One request's outcome: what SLO attainment is computed from."""

    index: int
    arrival: float
    ttft: float
    tpot: float  # mean time per output token after the first (0 for a one-token answer)
    output_tokens: int


@dataclass(slots=True)
class _Live:
    index: int
    arrival: float
    first_token: float | None = None
    last_token: float = 0.0


def prompt_tokens(index: int, request: TraceRequest) -> list[int]:
    """Token ids: the group's shared prefix, then a token unique to the request (so unrelated
    requests never share a block), then filler."""
    tokens: list[int] = []
    if request.prefix_group is not None and request.prefix_tokens:
        base = (zlib.crc32(request.prefix_group.encode()) & 0xFFFF) * 100_000 + 1_000_000
        tokens = list(range(base, base + request.prefix_tokens))
    tokens.append(100_000_000 + index)
    tokens.extend([_TOKEN] * (request.prompt_tokens - len(tokens)))
    return tokens[: request.prompt_tokens]


class _BucketCounts:
    """Prometheus-style cumulative buckets, kept as per-bucket counts."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * (len(bounds) + 1)

    def add(self, value: float, weight: float = 1.0) -> None:
        self.counts[bisect_left(self.bounds, value)] += weight

    def add_linear(self, start: float, step: float, n: int, weight: float) -> None:
        """`weight` observations of each of start, start + step, ..., start + (n-1) step."""
        if step <= 0:
            self.add(start, weight * n)
            return
        done = 0
        for index, bound in enumerate(self.bounds):
            upto = min(n, max(0, math.floor((bound - start) / step) + 1)) if bound >= start else 0
            if upto > done:
                self.counts[index] += weight * (upto - done)
                done = upto
        if done < n:
            self.counts[-1] += weight * (n - done)

    def histogram(self) -> Histogram:
        cumulative, total = {}, 0.0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            cumulative[bound] = total
        return Histogram(cumulative)


class SimReplica:
    """A replica from `created` (pod created) through `ready_at` to its removal."""

    def __init__(
        self,
        name: str,
        profile: ReplicaProfile,
        *,
        created: float,
        ready_at: float,
        on_finish: Callable[[Finished], None],
        itl: LogHistogram,
        prefix_caching: bool = True,
    ) -> None:
        self.name = name
        self.profile = profile
        self.created = created
        self.ready_at = ready_at
        self.removed_at: float | None = None
        self.draining = False
        self.now = ready_at
        self._on_finish = on_finish
        self._itl_all = itl
        kv = KVCacheManager(profile.num_kv_blocks, profile.block_size, enable_prefix_caching=prefix_caching)
        config = SchedulerConfig(
            max_num_batched_tokens=profile.max_num_batched_tokens,
            max_num_seqs=profile.max_num_seqs,
            max_model_len=profile.max_model_len,
            block_size=profile.block_size,
            enable_prefix_caching=prefix_caching,
        )
        self.kv = kv
        self.scheduler = Scheduler(config, kv, clock=lambda: self.now)
        self._live: dict[str, _Live] = {}
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self._ttft = _BucketCounts(TTFT_BUCKETS)
        self._itl = _BucketCounts(ITL_BUCKETS)
        self._tpot = _BucketCounts(TPOT_BUCKETS)  # per request, as kvasir_request_time_per_output_token
        self._queue = _BucketCounts(QUEUE_BUCKETS)  # arrival to first scheduled
        self.steps = 0

    # ---- requests --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._live)

    def submit(self, index: int, request: TraceRequest, now: float) -> None:
        if not self._live:
            self.now = max(self.now, now)  # idle until this arrival
        max_len = self.profile.max_model_len
        prompt = min(request.prompt_tokens, max_len - 1)
        output = max(1, min(request.output_tokens, max_len - prompt))
        clipped = TraceRequest(
            request.arrival_time, prompt, output, request.prefix_group, min(request.prefix_tokens, prompt)
        )
        r = Request(
            str(index), prompt_tokens(index, clipped), _PARAMS, max_tokens=output, seed=0, arrival_time=now
        )
        self.scheduler.add_request(r)
        self._live[r.request_id] = _Live(index, now)
        self.prompt_tokens += prompt

    # ---- time ------------------------------------------------------------------------------

    def advance(self, until: float) -> None:
        """Run engine steps that start before `until` (the last may end after it)."""
        scheduler = self.scheduler
        while self.now < until:
            if not scheduler.requests:
                self.now = until
                return
            steps = self._steady_steps(until)
            if steps >= 2:
                self._fast_forward(steps)
                continue
            if not self._step():
                self.now = until
                return

    def _step(self) -> bool:
        out = self.scheduler.schedule()
        if out.is_empty:
            return False
        kv_read = 0
        sampled = {}
        for item in out.scheduled:
            kv_read += item.start + item.num_tokens
            if item.sample:
                sampled[item.request.request_id] = [_TOKEN]
        dt = self.profile.step.step_time(out.num_batched_tokens, kv_read, len(out.scheduled))
        self.now += dt
        self.steps += 1
        for request in self.scheduler.update(out, sampled, self.now):
            self._on_token(request)
        return True

    def _on_token(self, request: Request) -> None:
        live = self._live[request.request_id]
        now = self.now
        self.generation_tokens += 1
        if live.first_token is None:
            live.first_token = now
            self._ttft.add(now - live.arrival)
            scheduled = request.times.first_scheduled
            self._queue.add(max(0.0, (now if scheduled is None else scheduled) - live.arrival))
        else:
            gap = now - live.last_token
            self._itl.add(gap)
            self._itl_all.add(gap)
        live.last_token = now
        if request.is_finished:
            del self._live[request.request_id]
            out = request.num_output_tokens
            tpot = (now - live.first_token) / (out - 1) if out > 1 else 0.0
            if out > 1:
                self._tpot.add(tpot)
            self._on_finish(Finished(live.index, live.arrival, live.first_token - live.arrival, tpot, out))

    def _steady_steps(self, until: float) -> int:
        """How many identical decode steps can run before `until` with nothing else happening."""
        scheduler = self.scheduler
        running = scheduler.running
        batch = len(running)
        if not batch or len(scheduler.waiting) or batch > self.profile.max_num_batched_tokens:
            return 0
        remaining = math.inf
        context = 0
        for r in running:
            if r.num_computed_tokens != len(r.all_token_ids) - 1:
                return 0
            remaining = min(remaining, r.max_tokens - len(r.output_token_ids))
            context += r.num_computed_tokens + 1
        steps = int(remaining) - 1  # the finishing step goes through the real scheduler
        if steps < 2:
            return 0
        alpha, slope = self._decode_step_times(batch, context)
        # now + k alpha + slope k (k-1) / 2 <= until
        budget = until - self.now
        if math.isinf(budget):
            k_time = steps
        elif slope > 0:
            a = slope / 2
            b = alpha - slope / 2
            k_time = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        else:
            k_time = int(budget / alpha)
        steps = min(steps, max(k_time, 0) + 1)  # the last one may end after `until`, as stepping would
        return min(steps, self._block_limited_steps(steps))

    def _decode_step_times(self, batch: int, context: int) -> tuple[float, float]:
        """(first step's duration, growth per step) of steady decode at this batch and context."""
        model = self.profile.step
        alpha = model.step_time(batch, context, batch)
        return alpha, model.per_kv_token_s * batch

    def _block_limited_steps(self, steps: int) -> int:
        """The most steps (<= steps) whose new blocks fit the free ones, so none preempts."""
        size = self.kv.block_size
        free = self.kv.num_free_blocks
        running = self.scheduler.running

        def needed(k: int) -> int:
            total = 0
            for r in running:
                held = -(-r.num_computed_tokens // size)
                total += -(-(r.num_computed_tokens + k) // size) - held
            return total

        if needed(steps) <= free:
            return steps
        low, high = 0, steps
        while low < high:
            middle = (low + high + 1) // 2
            if needed(middle) <= free:
                low = middle
            else:
                high = middle - 1
        return low

    def _fast_forward(self, steps: int) -> None:
        running = self.scheduler.running
        batch = len(running)
        context = sum(r.num_computed_tokens + 1 for r in running)
        alpha, slope = self._decode_step_times(batch, context)
        filler = [_TOKEN] * steps
        allocate = self.kv.allocate_slots
        for r in running:
            r.all_token_ids.extend(filler)
            r.output_token_ids.extend(filler)
            if not allocate(r, steps):
                raise RuntimeError("fast-forward: blocks ran out; _block_limited_steps is wrong")
            r.num_computed_tokens += steps
        elapsed = steps * alpha + slope * steps * (steps - 1) / 2
        self._itl.add_linear(alpha, slope, steps, batch)
        self._itl_all.add_linear(alpha, slope, steps, batch)
        self.now += elapsed
        self.steps += steps
        self.generation_tokens += steps * batch
        for r in running:
            self._live[r.request_id].last_token = self.now

    # ---- what the autoscaler sees -----------------------------------------------------------

    def metrics(self) -> PodMetrics:
        scheduler = self.scheduler
        return PodMetrics(
            gauges={
                "running": float(len(scheduler.running)),
                "waiting": float(len(scheduler.waiting)),
                "kv_usage": self.kv.usage,
                "time_to_ready": self.ready_at - self.created,
            },
            counters={
                "generation_tokens": float(self.generation_tokens),
                "prompt_tokens": float(self.prompt_tokens),
                "preemptions": float(scheduler.num_preemptions_total),
            },
            histograms={
                "ttft": self._ttft.histogram(),
                "itl": self._itl.histogram(),
                "tpot": self._tpot.histogram(),
                "queue_time": self._queue.histogram(),
            },
        )
