"""How much host work stays on the accelerator's critical path: synchronous vs async scheduling.

The engine runs with real scheduling, sampling metadata, sampling and detokenization, at batch 256,
but the model's forward pass is a stand-in that takes a fixed time T without holding the GIL (a
sleep): it stands for asynchronous GPU work, so the figures show what the host adds between two
device steps on any machine. For each mode it reports decode steps/s divided by 1/T, the share of
the step period the executor is busy (1.0 means the accelerator never waits for Python) and the
host time left on the critical path per step (step period - the executor's time, which is T plus
the sampler's tensor work: on a GPU that is device work too, here it runs on the CPU). The
synchronous engine is the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import print_header, print_table
from _random_model import ModelShape, random_model_files

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams

SHAPE = ModelShape(
    label="tiny Llama",
    architecture="LlamaForCausalLM",
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=1000,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
)


class StandInForward:
    """Replaces the model's forward pass: sleeps `step_s` (the GIL is free meanwhile), then
    returns varied hidden states so the real LM head and sampler pick varied tokens."""

    def __init__(self, model: torch.nn.Module, step_s: float, hidden_size: int) -> None:
        self.model = model
        self.step_s = step_s
        self.hidden = torch.randn(16384, hidden_size, generator=torch.Generator().manual_seed(0))
        self.calls = 0
        self.slept_s: list[float] = []  # what each sleep really took (the OS wakes it a little late)

    def __call__(self, input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        started = time.perf_counter()
        time.sleep(self.step_s)
        self.slept_s.append(time.perf_counter() - started)
        self.calls += 1
        offset = (self.calls * 7919) % (self.hidden.shape[0] - input_ids.shape[0])
        return self.hidden[offset : offset + input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def run(async_scheduling: bool, output_process: bool, args: argparse.Namespace) -> tuple[float, float, float]:
    """Seconds per decode step over `args.steps` steps, the device's share of each (the executor's
    time in `run_prepared`: the stand-in's T plus the LM head and the sampler's tensor work, which
    a GPU does in its stream too) and the part of that the stand-in slept."""
    max_len = args.prompt_len + args.steps + args.warmup + 8
    config = EngineConfig(
        model="random",
        device="cpu",
        dtype="float32",
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(8192, args.batch),
        num_kv_blocks=args.batch * (-(-max_len // 16) + 1),
        max_model_len=max_len,
        async_scheduling=async_scheduling,
        output_process=output_process,
    )
    engine = LLMEngine(config, random_model_files(SHAPE, torch.device("cpu"), torch.float32, seed=0))
    stand_in = StandInForward(engine.runner.model, args.step_ms / 1e3, SHAPE.hidden_size)
    engine.runner.model = stand_in  # type: ignore[assignment]
    rng = random.Random(0)
    for i in range(args.batch):
        # "mixed": half the requests sample (plain temperature: the sort of top-p/top-k is device
        # work on a GPU and would dominate a CPU step here) and a quarter check a stop string.
        mixed = args.sampling == "mixed"
        params = SamplingParams(
            temperature=0.8 if mixed and i % 2 == 0 else 0.0,
            seed=i,
            max_tokens=args.steps + args.warmup + 4,
            ignore_eos=True,
            stop=("never appears in the output",) if mixed and i % 4 == 0 else (),
        )
        prompt = [rng.randrange(4, SHAPE.vocab_size) for _ in range(args.prompt_len)]
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    device_s: list[float] = []
    run_prepared = engine.runner.run_prepared

    def timed_run_prepared(*run_args: Any) -> Any:
        started = time.perf_counter()
        try:
            return run_prepared(*run_args)
        finally:
            device_s.append(time.perf_counter() - started)

    engine.runner.run_prepared = timed_run_prepared  # type: ignore[method-assign]
    for _ in range(args.warmup):
        engine.step()
    assert engine.scheduler.num_running == args.batch and not engine.scheduler.num_waiting
    engine.step()  # the async engine returns a step late: settle before timing
    device_s.clear()
    stand_in.slept_s.clear()
    started = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    per_step = (time.perf_counter() - started) / args.steps
    device_per_step = sum(device_s[: args.steps]) / min(len(device_s), args.steps)
    slept_per_step = sum(stand_in.slept_s[: args.steps]) / min(len(stand_in.slept_s), args.steps)
    engine.close()
    return per_step, device_per_step, slept_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the stand-in's step time T")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs per mode; the best is kept")
    parser.add_argument(
        "--sampling",
        choices=["greedy", "mixed"],
        default="greedy",
        help="greedy: every request (as benchmarks/step_overhead.py); mixed: half sample, a quarter have a stop string",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print_header("Host work on the critical path: sync vs async scheduling", sys.argv)
    modes = {
        "synchronous, text in-process (baseline)": (False, False),
        "synchronous, output process": (False, True),
        "async scheduling, text in-process": (True, False),
        "async scheduling, output process (default with CUDA)": (True, True),
    }
    best = dict.fromkeys(modes, (float("inf"), 0.0, 0.0))
    for _ in range(args.rounds):
        for label, (async_scheduling, output_process) in modes.items():
            best[label] = min(best[label], run(async_scheduling, output_process, args))
    step_s = args.step_ms / 1e3
    print(
        f"batch {args.batch}, stand-in step T = {args.step_ms} ms, {args.steps} decode steps per run, "
        f"best of {args.rounds}, {args.sampling} sampling\n"
    )
    rows = []
    baseline = best["synchronous, text in-process (baseline)"][0]
    for label, (per_step, device, slept) in best.items():
        rows.append(
            [
                label,
                1 / per_step,
                baseline / per_step,
                step_s / per_step,
                device * 1e3,
                slept * 1e3,
                (device - slept) * 1e3,
                device / per_step,
                (per_step - device) * 1e3,
            ]
        )
    print_table(
        [
            "engine",
            "steps/s",
            "vs baseline",
            "steps/s / (1/T)",
            "device ms per step",
            "of which slept",
            "of which executor CPU",
            "device busy",
            "host ms on the critical path per step",
        ],
        rows,
    )
    print(
        "\ndevice ms: the executor's time per step: the stand-in's sleep (T, and the OS's late wake-up)"
        "\nplus executor CPU (the LM head, the sampler's tensor work and the executor's own Python, all"
        "\nwaiting for the GIL when the engine thread holds it; on a GPU the tensor work is device work)."
        "\ndevice busy = device ms / step period; host ms = period - device ms."
    )


if __name__ == "__main__":
    main()
