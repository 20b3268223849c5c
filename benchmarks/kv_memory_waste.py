"""KV-cache memory waste of the paged cache at peak, against a contiguous max-length reservation.

Drives the real Scheduler and KVCacheManager with fake sampled tokens (no model): requests with
prompts of 16-256 tokens and outputs of 8-512 (EOS ignored) keep `--concurrency` sequences
running. After every schedule(), the slots held by requests are compared with the slots their
tokens fill (computed tokens plus this step's, whose KV the step writes). Waste is
allocated-but-unused slots / allocated slots; a contiguous cache reserves max_model_len slots per
sequence whatever its length. Only the last, partly filled block of a sequence can be waste.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fake_request, fake_sampled_tokens, mean, print_header, print_table

from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class Occupancy:
    """Slots held and slots filled across all sequences of one step."""

    num_running: int
    allocated: int
    used: int

    @property
    def waste(self) -> float:
        return (self.allocated - self.used) / self.allocated if self.allocated else 0.0


@dataclass(frozen=True)
class WasteResult:
    block_size: int
    peak: Occupancy  # the full-concurrency step with the most slots allocated
    mean_waste: float  # over every step at full concurrency
    num_full_steps: int
    preemptions: int


def occupancy(scheduler: Scheduler, plan: SchedulerOutput, kv_cache: KVCacheManager) -> Occupancy:
    """Distinct held blocks' slots vs the slots filled once this step's KV is written."""
    block_size = kv_cache.block_size
    scheduled = {item.request_id: item.start + item.num_tokens for item in plan.scheduled}
    filled: dict[int, int] = {}  # block id -> slots filled (a shared prefix block counts once)
    for request in scheduler.running:
        num_tokens = scheduled.get(request.request_id, request.num_computed_tokens)
        for index, block_id in enumerate(kv_cache.block_ids(request.request_id)):
            filled[block_id] = max(filled.get(block_id, 0), min(block_size, num_tokens - index * block_size))
    held = kv_cache.num_blocks - kv_cache.num_free_blocks
    if held != len(filled):
        raise RuntimeError(f"{held} blocks are held but the running requests list {len(filled)}")
    return Occupancy(len(scheduler.running), held * block_size, sum(filled.values()))


def run(args: argparse.Namespace, block_size: int) -> WasteResult:
    rng = random.Random(args.seed)
    max_model_len = args.max_prompt + args.max_output
    # Room for every sequence at max_model_len plus the admission watermark: no preemption.
    num_blocks = int(args.concurrency * -(-max_model_len // block_size) / 0.98) + 1
    kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.concurrency,
            max_model_len=max_model_len,
            block_size=block_size,
        ),
        kv_cache,
    )
    for index in range(args.num_requests):
        scheduler.add_request(
            fake_request(
                rng,
                f"r{index}",
                (args.min_prompt, args.max_prompt),
                (args.min_output, args.max_output),
                args.vocab_size,
            )
        )
    peak: Occupancy | None = None
    wastes = []
    now = 0.0
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        seen = occupancy(scheduler, plan, kv_cache)
        if seen.num_running == args.concurrency:
            wastes.append(seen.waste)
            if peak is None or seen.allocated > peak.allocated:
                peak = seen
        now += 1.0
        scheduler.update(plan, fake_sampled_tokens(plan, rng, args.vocab_size), now)
    kv_cache.check_integrity()
    if peak is None:
        raise RuntimeError(f"never reached {args.concurrency} running sequences; add requests")
    return WasteResult(block_size, peak, mean(wastes), len(wastes), scheduler.num_preemptions_total)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=256, help="running sequences (max_num_seqs)")
    parser.add_argument("--num-requests", type=int, default=1024)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_header("KV-cache memory waste at peak: paged blocks vs contiguous max-length reservation")
    max_model_len = args.max_prompt + args.max_output
    print(
        f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, outputs "
        f"{args.min_output}-{args.max_output} (EOS ignored), {args.concurrency} running, "
        f"max_model_len {max_model_len}; real Scheduler + KVCacheManager, fake sampled tokens\n"
    )
    results = [run(args, block_size) for block_size in args.block_sizes]
    rows = []
    for result in results:
        peak = result.peak
        contiguous = peak.num_running * max_model_len
        rows.append(
            [
                f"paged, block {result.block_size}",
                peak.allocated,
                peak.used,
                peak.waste,
                result.mean_waste,
                result.num_full_steps,
                result.preemptions,
            ]
        )
        rows.append(
            [
                f"contiguous max_model_len (same step as block {result.block_size})",
                contiguous,
                peak.used,
                (contiguous - peak.used) / contiguous,
                float("nan"),
                "",
                "",
            ]
        )
    print_table(
        [
            "layout",
            "slots allocated at peak",
            "slots used",
            "waste at peak",
            f"mean waste ({args.concurrency} running)",
            "steps measured",
            "preemptions",
        ],
        rows,
    )
    by_size = {result.block_size: result for result in results}
    if 16 in by_size:
        waste = by_size[16].peak.waste
        verdict = "met" if waste <= 0.04 else "MISSED"
        print(f"goal: waste at peak <= 4% at block size 16: {waste:.2%} ({verdict})")


if __name__ == "__main__":
    main()
