"""Multi-LoRA serving on the embedded model (SmolLM2-135M Q4_1 GGUF, 30 layers), on the CPU.

    python benchmarks/lora.py                        # batch 8, 4 adapters of rank 16, 3 rounds
    python benchmarks/lora.py --batch 8 --rounds 5 --threads 2
    python benchmarks/lora.py --lora-dtype bfloat16  # the slot pool in bfloat16: half the bytes

Three figures, each a ratio of medians measured in this one process (rounds alternate, ABAB):
(a) `--enable-lora` with a base-only batch against the flag off: decode step time, on/off
    (target <= 1.03: a batch with no adapter row runs the base code);
(b) `--batch` requests spread evenly over 4 random rank-16 adapters (all seven projections)
    against the same batch on the base model: decode throughput, adapters/base (target >= 0.8);
(c) the same adapters served by swapping merged weights, against ours (target: ours >= 2x).
    Emulated: a server holding one merged copy of the weights must, for every decode step of a
    batch spread over 4 adapters, write each adapter's merged projections into the model and run
    that adapter's rows alone. Its step is measured as 4 x (a copy of every q/k/v/o/gate/up/down
    buffer of the model from a stash of 4 pre-made sets, the time a swap costs; plus a decode
    step of batch/4 rows on the base engine). The copied bytes are the base weights' (merging
    and requantising would cost more and is left out, in the baseline's favour); outputs of that
    emulation are not read. "no swap cost" is the same baseline with the copies left out.
Times are process CPU time (`time.process_time`) of `ModelRunner.execute`, medians over every
decode step of every round (a round generates `--tokens` tokens per request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import print_header, print_table
from safetensors.torch import save_file

from kvasir.runtime.config import LORA_DTYPES, EngineConfig, ModelConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.loader.lora_adapter import TARGET_MODULES, module_shapes, read_adapter_digest
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingParams

NUM_ADAPTERS, RANK = 4, 16


def write_random_adapter(path: Path, config: ModelConfig, seed: int) -> Path:
    """A rank-16 adapter in PEFT's layout on all seven projections, random A and B."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (n_in, n_out) in module_shapes(config).items():
            parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, n_in, generator=generator) / n_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, RANK, generator=generator) * 0.01
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(TARGET_MODULES)})
    )
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


class StepTimer:
    """Process CPU time of each `ModelRunner.execute` of an engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[float] = []
        real = engine.runner.execute

        def execute(plan: Any) -> Any:
            started = time.process_time()
            result = real(plan)
            self.steps.append(time.process_time() - started)
            return result

        engine.runner.execute = execute  # type: ignore[method-assign]


def decode_round(engine: LLMEngine, timer: StepTimer, loras: list[LoRARequest | None], tokens: int) -> None:
    """One request per entry of `loras` (None: the base model), `tokens` greedy tokens each; the
    first (prefill) step is not kept."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    first = len(timer.steps)
    for i, lora in enumerate(loras):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(16)]
        engine.add_request(f"r{time.monotonic_ns()}-{i}", None, params, prompt_token_ids=prompt, lora=lora)
    while engine.has_unfinished():
        engine.step()
    del timer.steps[first]


def projection_buffers(engine: LLMEngine) -> list[torch.Tensor]:
    """Every tensor of the model's q/k/v/o/gate/up/down projections (what a merged swap rewrites)."""
    found = []
    for layer in engine.runner.model.model.layers:  # type: ignore[union-attr]
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            found += [
                t
                for t in (*linear.buffers(), *linear.parameters())
                if t.is_floating_point() or t.dtype == torch.uint8
            ]
    return found


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8, help="requests per batch (a multiple of 4)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--lora-dtype",
        choices=LORA_DTYPES,
        default="auto",
        help="the slot pool's dtype (auto: float32 on CPU)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print_header("Multi-LoRA serving on the embedded model (CPU)", sys.argv)
    common = {"model": str(embedded_model_path()), "device": "cpu", "max_model_len": 16 + args.tokens + 16}
    off = LLMEngine(EngineConfig(**common))
    on = LLMEngine(
        EngineConfig(
            **common,
            enable_lora=True,
            max_loras=NUM_ADAPTERS,
            max_lora_rank=RANK,
            lora_dtype=args.lora_dtype,
        )
    )
    config = on.runner.model_config
    with tempfile.TemporaryDirectory() as root:
        loras = []
        for i in range(NUM_ADAPTERS):
            path = write_random_adapter(Path(root) / f"a{i}", config, seed=i)
            loras.append(
                LoRARequest(f"a{i}", i + 1, str(path), read_adapter_digest(path, config, RANK), RANK)
            )
            on.runner.add_lora(loras[-1])
    spread: list[LoRARequest | None] = [loras[i % NUM_ADAPTERS] for i in range(args.batch)]
    base: list[LoRARequest | None] = [None] * args.batch
    timers = {"off": StepTimer(off), "on": StepTimer(on)}
    lora_timer = StepTimer.__new__(StepTimer)
    lora_timer.steps = []
    swap_buffers = projection_buffers(off)
    stash = [[t.clone() for t in swap_buffers] for _ in range(NUM_ADAPTERS)]
    swaps: list[float] = []
    sub_timer = StepTimer.__new__(StepTimer)
    sub_timer.steps = []

    def measure(rounds: int) -> None:
        for _ in range(rounds):
            decode_round(off, timers["off"], base, args.tokens)
            decode_round(on, timers["on"], base, args.tokens)
            before = len(timers["on"].steps)
            decode_round(on, timers["on"], spread, args.tokens)
            lora_timer.steps += timers["on"].steps[before:]
            del timers["on"].steps[before:]
            before = len(timers["off"].steps)
            decode_round(off, timers["off"], base[: args.batch // NUM_ADAPTERS], args.tokens)
            sub_timer.steps += timers["off"].steps[before:]
            del timers["off"].steps[before:]
            for weights in stash:
                started = time.process_time()
                for target, source in zip(swap_buffers, weights, strict=True):
                    target.copy_(source)
                swaps.append(time.process_time() - started)

    measure(1)  # warm-up, not kept
    for steps in (timers["off"].steps, timers["on"].steps, lora_timer.steps, sub_timer.steps, swaps):
        steps.clear()
    measure(args.rounds)
    med = {
        name: statistics.median(values) * 1e3
        for name, values in [
            ("off", timers["off"].steps),
            ("on", timers["on"].steps),
            ("lora", lora_timer.steps),
            ("sub", sub_timer.steps),
            ("swap", swaps),
        ]
    }
    merged_step = NUM_ADAPTERS * (med["swap"] + med["sub"])
    merged_no_swap = NUM_ADAPTERS * med["sub"]
    rows = [
        [
            "(a) base batch, --enable-lora off",
            f"{med['off']:.2f}",
            f"{args.batch / med['off'] * 1e3:.0f}",
            "",
        ],
        [
            "(a) base batch, --enable-lora on",
            f"{med['on']:.2f}",
            f"{args.batch / med['on'] * 1e3:.0f}",
            f"on/off step {med['on'] / med['off']:.3f} (target <= 1.03)",
        ],
        [
            "(b) batch over 4 adapters, batched LoRA",
            f"{med['lora']:.2f}",
            f"{args.batch / med['lora'] * 1e3:.0f}",
            f"vs base {med['on'] / med['lora']:.3f} (target >= 0.8)",
        ],
        [
            "(c) merged swap: 4 x (swap + batch/4 step)",
            f"{merged_step:.2f}",
            f"{args.batch / merged_step * 1e3:.0f}",
            f"ours/merged {merged_step / med['lora']:.2f} (target >= 2)",
        ],
        [
            "(c) merged, no swap cost: 4 x batch/4 step",
            f"{merged_no_swap:.2f}",
            f"{args.batch / merged_no_swap * 1e3:.0f}",
            f"ours/merged {merged_no_swap / med['lora']:.2f}",
        ],
    ]
    assert on.runner.lora is not None
    print(f"LoRA slot pool: {on.runner.lora.dtype}, {on.runner.lora.nbytes / 2**20:.0f} MiB")
    print(
        f"swap (copy of {sum(t.nbytes for t in swap_buffers) / 2**20:.0f} MiB of projections): {med['swap']:.2f} ms; "
        f"decode step of {args.batch // NUM_ADAPTERS} rows: {med['sub']:.2f} ms; steps per figure: {len(lora_timer.steps)}"
    )
    print_table(["what", "decode step ms", "tokens/s", "ratio"], rows)


if __name__ == "__main__":
    main()
