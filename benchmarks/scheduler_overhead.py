"""CPU time of the scheduler per step: schedule() + update() with 256 running and N waiting.

The real Scheduler and KVCacheManager (prefix caching on, blocks enough for every running request
at max_model_len) are driven by a fake model that returns a random token for each request that
samples. The loop is closed: each request that finishes is replaced by a new arrival, so the
running set stays full and the queue stays at N for the whole measurement, and every run sees the
same churn (admissions with their prompt chunks, finishes, block frees). The fake model and the
arrivals are not timed; schedule() and update() are.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fake_request, fake_sampled_tokens, mean, percentile, print_header, print_table

from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class StepTimes:
    num_waiting: int
    schedule_ms: list[float]
    update_ms: list[float]
    num_running: list[int]
    num_batched_tokens: list[int]
    queue_len: list[int]  # waiting requests when the step began (new arrivals included)

    @property
    def step_ms(self) -> list[float]:
        return [s + u for s, u in zip(self.schedule_ms, self.update_ms, strict=True)]


def run(args: argparse.Namespace, num_waiting: int) -> StepTimes:
    rng = random.Random(args.seed)
    max_model_len = args.max_prompt + args.max_output
    blocks_per_seq = -(-max_model_len // args.block_size)
    # Every running request can reach max_model_len, with the admission watermark on top.
    num_blocks = int(args.num_running * blocks_per_seq / 0.98) + 1
    kv_cache = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=True)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.num_running,
            max_model_len=max_model_len,
            block_size=args.block_size,
        ),
        kv_cache,
    )
    counter = 0

    def arrive() -> None:
        nonlocal counter
        request = fake_request(
            rng,
            f"r{counter}",
            (args.min_prompt, args.max_prompt),
            (args.min_output, args.max_output),
            args.vocab_size,
        )
        scheduler.add_request(request)
        counter += 1

    for _ in range(args.num_running + num_waiting):
        arrive()
    times = StepTimes(num_waiting, [], [], [], [], [])
    clock = time.perf_counter_ns
    gc.collect()
    for step in range(args.warmup_steps + args.steps):
        queue_len = scheduler.num_waiting
        started = clock()
        plan = scheduler.schedule()
        scheduled = clock()
        sampled = fake_sampled_tokens(plan, rng, args.vocab_size)
        resumed = clock()
        updated = scheduler.update(plan, sampled, float(step))
        finished = clock()
        for request in updated:
            if request.is_finished:
                arrive()
        if step >= args.warmup_steps:
            times.schedule_ms.append((scheduled - started) / 1e6)
            times.update_ms.append((finished - resumed) / 1e6)
            times.num_running.append(len(plan.scheduled))
            times.num_batched_tokens.append(plan.num_batched_tokens)
            times.queue_len.append(queue_len)
    return times


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--waiting", type=int, nargs="+", default=[0, 1_000, 10_000])
    parser.add_argument("--steps", type=int, default=1000, help="measured steps per configuration")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_header("scheduler overhead per step: schedule() + update(), fake model")
    print(
        f"{args.num_running} running (max_num_seqs), prompts {args.min_prompt}-{args.max_prompt}, outputs "
        f"{args.min_output}-{args.max_output}, block size {args.block_size}, prefix caching on, "
        f"{args.steps} measured steps after {args.warmup_steps} warm-up steps; closed loop\n"
    )
    results = [run(args, num_waiting) for num_waiting in args.waiting]
    base = percentile(results[0].step_ms, 50)
    rows = []
    for result in results:
        step = result.step_ms
        rows.append(
            [
                result.num_waiting,
                mean(result.queue_len),
                mean(result.num_running),
                mean(result.num_batched_tokens),
                percentile(result.schedule_ms, 50),
                percentile(result.update_ms, 50),
                percentile(step, 50),
                percentile(step, 90),
                percentile(step, 99),
                max(step),
                percentile(step, 50) / base,
            ]
        )
    print_table(
        [
            "waiting",
            "mean queue",
            "mean scheduled",
            "mean tokens/step",
            "schedule p50 ms",
            "update p50 ms",
            "step p50 ms",
            "step p90 ms",
            "step p99 ms",
            "step max ms",
            f"p50 / p50 at {results[0].num_waiting} waiting",
        ],
        rows,
    )
    worst = max(percentile(result.step_ms, 50) for result in results)
    print(f"goal: step p50 under 1 ms and flat in the number waiting: worst p50 {worst:.3f} ms")


if __name__ == "__main__":
    main()
