"""Continuous batching (Kvasir) against static batching (`transformers.generate`), same CPU, same model.

Every request has its own output length (EOS ignored). A static batch of B requests runs until its
longest request is done, so the short ones waste their slots; Kvasir keeps B requests running and
refills a slot the step after it frees. Both sides run the same random-weight Llama with the same
concurrency (Kvasir's max_num_seqs = the static batch size), in one process, one after the other.

Slot utilization = useful tokens / token slots fed to the model, where a request's useful tokens
are prompt + output - 1 (its last sampled token is never fed back). Static batching feeds
B x (longest prompt + longest output - 1) per batch; Kvasir feeds what its steps schedule
(`num_batched_tokens`), recomputation after a preemption included.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    EOS_ID,
    FIRST_PLAIN_ID,
    PAD_ID,
    TinyLlamaSpec,
    build_random_llama,
    mean,
    print_header,
    print_table,
)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(len(p) + o - 1 for p, o in zip(self.prompts, self.output_lens, strict=True))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for _ in range(args.num_requests):
        length = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append([rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(length)])
        output_lens.append(rng.randint(args.min_output, args.max_output))
    return Workload(prompts, output_lens)


def static_batches(workload: Workload, batch_size: int) -> list[range]:
    n = len(workload.prompts)
    return [range(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]


def ideal_gain(workload: Workload, batch_size: int) -> float:
    """Mean over static batches of (longest output / mean output): what removing the padding buys."""
    gains = []
    for batch in static_batches(workload, batch_size):
        lens = [workload.output_lens[i] for i in batch]
        gains.append(max(lens) / mean(lens))
    return mean(gains)


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds, and this process's CPU seconds (immune to other users of a shared machine)."""

    wall_s: float
    cpu_s: float


class Stopwatch:
    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self) -> Timing:
        return Timing(time.perf_counter() - self._wall, time.process_time() - self._cpu)


def run_static(model: object, workload: Workload, batch_size: int) -> tuple[Timing, int]:
    """transformers.generate over left-padded static batches; returns (timing, slots fed)."""
    import torch

    slots = 0
    watch = Stopwatch()
    for batch in static_batches(workload, batch_size):
        prompts = [workload.prompts[i] for i in batch]
        longest_prompt = max(len(p) for p in prompts)
        longest_output = max(workload.output_lens[i] for i in batch)
        ids = torch.full((len(prompts), longest_prompt), PAD_ID, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, longest_prompt - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest_prompt - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(  # type: ignore[attr-defined]
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=longest_output,
                min_new_tokens=longest_output,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
            )
        if out.shape[1] != longest_prompt + longest_output:
            raise RuntimeError(
                f"transformers generated {out.shape[1] - longest_prompt} tokens, not {longest_output}"
            )
        slots += len(prompts) * (longest_prompt + longest_output - 1)
    return watch.stop(), slots


def run_continuous(
    folder: Path, workload: Workload, args: argparse.Namespace, *, host_overlap: bool | None = None
) -> tuple[Timing, int, int]:
    """Kvasir with every request submitted at once; returns (timing, slots fed, preemptions).

    `host_overlap` turns async scheduling and the output process on or off (None: the engine's
    defaults, on with CUDA and off on a CPU)."""
    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.core.scheduler_output import SchedulerOutput
    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.sample.params import SamplingParams

    max_model_len = args.max_prompt + args.max_output
    blocks_per_seq = -(-max_model_len // args.block_size)
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cpu",
            dtype="float32",
            max_model_len=max_model_len,
            block_size=args.block_size,
            num_kv_blocks=args.batch_size * blocks_per_seq + 1,  # no preemption at full concurrency
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            async_scheduling=host_overlap,
            output_process=host_overlap,
        )
    )
    fed: list[int] = []
    schedule, schedule_ahead = engine.scheduler.schedule, engine.scheduler.schedule_ahead

    def recording_schedule() -> SchedulerOutput:
        plan = schedule()
        fed.append(plan.num_batched_tokens)
        return plan

    def recording_schedule_ahead(in_flight: SchedulerOutput) -> SchedulerOutput | None:
        plan = schedule_ahead(in_flight)
        if plan is not None:
            fed.append(plan.num_batched_tokens)
        return plan

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    engine.scheduler.schedule_ahead = recording_schedule_ahead  # type: ignore[method-assign]
    _warm_up(engine)
    fed.clear()
    preemptions_before = engine.stats().num_preemptions

    watch = Stopwatch()
    for index, (prompt, output_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        engine.add_request(f"r{index}", params=params, prompt_token_ids=prompt)
    generated = 0
    while engine.has_unfinished():
        for output in engine.step():
            generated += sum(len(choice.token_ids) for choice in output.outputs)
    elapsed = watch.stop()
    if generated != workload.output_tokens:
        raise RuntimeError(f"Kvasir generated {generated} tokens, expected {workload.output_tokens}")
    preemptions = engine.stats().num_preemptions - preemptions_before
    engine.close()
    return elapsed, sum(fed), preemptions


def _warm_up(engine: object) -> None:
    from kvasir.runtime.sample.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate([[FIRST_PLAIN_ID] * 20, [FIRST_PLAIN_ID + 1] * 7], params)  # type: ignore[attr-defined]


def compare_host_overlap(spec: TinyLlamaSpec, workload: Workload, args: argparse.Namespace) -> None:
    """The real model on this CPU, before and after taking host work off the step's critical path:
    `--rounds` alternating runs of each, the median kept (this machine is shared and noisy)."""
    modes = {"synchronous, text in-process (before)": False, "async + output process (after)": True}
    timings: dict[bool, list[Timing]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-") as tmp:
        folder = Path(tmp) / "model"
        build_random_llama(folder, spec)  # the checkpoint on disk; the transformers copy is not needed
        for round_index in range(args.rounds):
            for label, overlap in modes.items():
                timing, _, _ = run_continuous(folder, workload, args, host_overlap=overlap)
                timings[overlap].append(timing)
                print(f"round {round_index + 1}: {label} {timing.wall_s:.1f}s", flush=True)
    out = workload.output_tokens
    rows, medians = [], {}
    for label, overlap in modes.items():
        wall = statistics.median(t.wall_s for t in timings[overlap])
        cpu = statistics.median(t.cpu_s for t in timings[overlap])
        medians[overlap] = wall
        rows.append(
            [
                label,
                wall,
                cpu,
                out / wall,
                min(out / t.wall_s for t in timings[overlap]),
                max(out / t.wall_s for t in timings[overlap]),
            ]
        )
    print()
    print_table(
        [
            "Kvasir engine",
            "median wall s",
            "median CPU s (this process)",
            "output tok/s (median)",
            "min",
            "max",
        ],
        rows,
    )
    print(f"\nafter / before throughput (medians, wall): {medians[False] / medians[True]:.3f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size = Kvasir max_num_seqs")
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--min-output", type=int, default=8)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine two OpenMP threads stall on each other)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--host-overlap-comparison",
        action="store_true",
        help="Kvasir only: without async scheduling and the output process, then with them (the defaults)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating runs per mode (--host-overlap-comparison)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print_header("continuous (Kvasir) vs static (transformers.generate) batching")
    spec = TinyLlamaSpec(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=max(2048, args.max_prompt + args.max_output),
        seed=args.seed,
    )
    workload = make_workload(args, spec.vocab_size)
    print(
        f"model: random Llama, hidden {spec.hidden_size}, {spec.num_layers} layers, {spec.num_heads} heads / "
        f"{spec.num_kv_heads} KV heads, vocab {spec.vocab_size}, float32"
    )
    print(
        f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
        f"outputs {args.min_output}-{args.max_output} (uniform, EOS ignored), concurrency {args.batch_size}; "
        f"{workload.output_tokens} output tokens"
    )
    if args.host_overlap_comparison:
        compare_host_overlap(spec, workload, args)
        return
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-") as tmp:
        folder = Path(tmp) / "model"
        model = build_random_llama(folder, spec)
        run_static(model, Workload(workload.prompts[:2], [4, 4]), 2)  # warm-up
        hf_time, hf_slots = run_static(model, workload, args.batch_size)
        print(f"transformers.generate done in {hf_time.wall_s:.1f}s", flush=True)
        del model
        kv_time, kv_slots, preemptions = run_continuous(folder, workload, args)
        print(f"Kvasir done in {kv_time.wall_s:.1f}s ({preemptions} preemptions)\n", flush=True)

    useful = workload.useful_tokens
    out = workload.output_tokens
    ideal = ideal_gain(workload, args.batch_size)
    print_table(
        [
            "engine",
            "wall s",
            "CPU s",
            "output tok/s (wall)",
            "output tok/s (CPU)",
            "slots fed",
            "useful tokens",
            "slot utilization",
        ],
        [
            [
                "transformers static",
                hf_time.wall_s,
                hf_time.cpu_s,
                out / hf_time.wall_s,
                out / hf_time.cpu_s,
                hf_slots,
                useful,
                useful / hf_slots,
            ],
            [
                "Kvasir continuous",
                kv_time.wall_s,
                kv_time.cpu_s,
                out / kv_time.wall_s,
                out / kv_time.cpu_s,
                kv_slots,
                useful,
                useful / kv_slots,
            ],
        ],
    )
    gain_wall = hf_time.wall_s / kv_time.wall_s
    gain_cpu = hf_time.cpu_s / kv_time.cpu_s
    print_table(
        ["clock", "Kvasir / static throughput", "ideal gain (mean max/mean output)", "fraction of ideal"],
        [["wall", gain_wall, ideal, gain_wall / ideal], ["process CPU", gain_cpu, ideal, gain_cpu / ideal]],
    )
    print(
        f"goals: Kvasir slot utilization >= 0.95 (got {useful / kv_slots:.3f}); "
        f"gain >= 0.90 of ideal (got {gain_wall / ideal:.3f} wall, {gain_cpu / ideal:.3f} CPU)"
    )


if __name__ == "__main__":
    main()
