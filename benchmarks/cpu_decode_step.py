"""The CPU decode step of the embedded model (SmolLM2-135M Q4_1 GGUF, 30 layers): the torch
reference ops, the step's C kernels called layer by layer, and the C decoder stack, in one process.

    python benchmarks/cpu_decode_step.py                    # batch 1, 8 and 32, 3 rounds
    python benchmarks/cpu_decode_step.py --batches 1 --rounds 5 --threads 1
    python benchmarks/cpu_decode_step.py --memory           # resident memory of each variant

Three engines load the same GGUF:
- `reference`: the torch-reference paged attention (gathers each request's blocks, one SDPA per
  layer), torch RMSNorm and rotary, and a float32 KV cache zeroed at start: the step before the
  C kernels of `kvasir.kernels.cpu_ops.paged_attention` and `rms_norm` (they are switched off for
  this engine by patching their `takes`/`supports` to False while it runs);
- `layers`: those C kernels and a float16 KV cache, each called from the layer's Python code
  (`KVASIR_CPU_DECODER_STACK=0`);
- `stack`: the defaults: every layer of the step in one call of the C decoder stack
  (`kvasir.kernels.cpu_ops.decoder_stack`), the same kernels called from C.
All three run the packed GEMM C kernel. `--memory` instead starts one process per variant and
reports its resident memory after loading (KV cache allocated) and its peak after generating for
`--batches`' largest batch, with the default KV budget (`--kv-cache-bytes`, 1 GiB). A round
generates `--tokens` greedy tokens for `batch` requests of a `--prompt`-token prompt with each
engine in turn (ABAB); a decode step is one `ModelRunner.execute` (inputs, forward pass and
sampler). For the two layer-by-layer variants the GEMM share is the time inside the GEMM kernel's
Python wrapper; the stack calls its GEMMs from C, so only its LM head's GEMM is seen there (its
split is not shown). Times are the process's CPU time (`time.process_time`), not wall time: on a
shared machine a descheduled step would otherwise count another process's work. With more than
one thread, CPU time adds the threads up. Medians over every decode step of every round.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import print_header, print_table

from kvasir.kernels.cpu_ops import group_affine, paged_attention, rms_norm
from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.models import cpu_decoder_stack
from kvasir.runtime.sample.params import SamplingParams

VARIANTS = ("reference", "layers", "stack")


@contextlib.contextmanager
def step_kernels_off() -> Iterator[None]:
    """The reference variant: the step's C kernels decline every call (the GEMM's still runs)."""
    saved = paged_attention.takes, rms_norm.supports
    paged_attention.takes = lambda *args: False  # type: ignore[assignment]
    rms_norm.supports = lambda *args: False  # type: ignore[assignment]
    try:
        yield
    finally:
        paged_attention.takes, rms_norm.supports = saved  # type: ignore[assignment]


@contextlib.contextmanager
def variant_context(variant: str) -> Iterator[None]:
    """What `variant` switches off while its engine is built and runs."""
    if variant == "reference":
        with step_kernels_off():
            yield
    elif variant == "layers":
        saved = os.environ.get(cpu_decoder_stack.DISABLE_ENV)
        os.environ[cpu_decoder_stack.DISABLE_ENV] = "0"
        try:
            yield
        finally:
            if saved is None:
                del os.environ[cpu_decoder_stack.DISABLE_ENV]
            else:
                os.environ[cpu_decoder_stack.DISABLE_ENV] = saved
    else:
        yield


class StepTimer:
    """Wraps an engine's `execute` and the packed GEMM (`TiledGemm.run`): (step seconds, GEMM seconds) per step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[float, float]] = []
        self._gemm = 0.0
        real_execute, real_gemm = engine.runner.execute, group_affine.TiledGemm.run

        def gemm(*args: Any) -> Any:
            started = time.process_time()
            try:
                return real_gemm(*args)
            finally:
                self._gemm += time.process_time() - started

        def execute(plan: Any) -> Any:
            gemm_before, started = self._gemm, time.process_time()
            result = real_execute(plan)
            self.steps.append((time.process_time() - started, self._gemm - gemm_before))
            return result

        engine.runner.execute = execute  # type: ignore[method-assign]
        self.real_gemm, self.timed_gemm = real_gemm, gemm


def build_config(variant: str, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=str(embedded_model_path()),
        device="cpu",
        max_model_len=args.prompt + args.tokens + 16,
        kv_cache_dtype="float32" if variant == "reference" else "auto",
        max_num_seqs=max(args.batches),
    )


def build(variant: str, args: argparse.Namespace) -> LLMEngine:
    with variant_context(variant):
        return LLMEngine(build_config(variant, args))


def run_round(
    engine: LLMEngine, timer: StepTimer, variant: str, batch: int, args: argparse.Namespace
) -> None:
    prompts = [[(7 * r + i) % 1000 + 10 for i in range(args.prompt)] for r in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    group_affine.TiledGemm.run = timer.timed_gemm  # type: ignore[method-assign]
    first = len(timer.steps)
    try:
        with variant_context(variant):
            engine.generate(prompts, params)
    finally:
        group_affine.TiledGemm.run = timer.real_gemm  # type: ignore[method-assign]
    del timer.steps[first]  # the prefill step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", action="store_true", help="resident memory per variant instead")
    parser.add_argument("--child-memory", choices=VARIANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def memory_child(variant: str, args: argparse.Namespace) -> None:
    """Runs in a child process: print MiB resident after loading and at peak after generating."""
    config = dataclasses.replace(build_config(variant, args), max_num_seqs=max(args.batches))
    with variant_context(variant):
        engine = LLMEngine(config)
    loaded = _status_mib("VmRSS")
    batch = max(args.batches)
    prompts = [[(7 * r + i) % 1000 + 10 for i in range(args.prompt)] for r in range(batch)]
    with variant_context(variant):
        engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True))
    kv = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches) / 2**20
    print(f"{loaded} {_status_mib('VmHWM')} {kv}")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory(args: argparse.Namespace, argv: list[str]) -> None:
    rows = []
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, *argv, "--child-memory", variant],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        loaded, peak, kv = (float(value) for value in out[-3:])
        rows.append([variant, loaded, peak, kv])
    print_table(["variant", "RSS after load MiB", "peak RSS MiB", "KV cache allocated MiB"], rows)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.child_memory:
        memory_child(args.child_memory, args)
        return
    print_header(
        "CPU decode step of the embedded model: reference ops, C kernels layer by layer, C stack", sys.argv
    )
    if args.memory:
        memory(args, [a for a in sys.argv[1:] if a != "--memory"])
        return
    engines = {variant: build(variant, args) for variant in VARIANTS}
    rows = []
    for batch in args.batches:
        timers = {variant: StepTimer(engine) for variant, engine in engines.items()}
        for variant, engine in engines.items():  # warm-up round, not timed
            run_round(engine, timers[variant], variant, batch, args)
            timers[variant].steps.clear()
        for _ in range(args.rounds):
            for variant, engine in engines.items():
                run_round(engine, timers[variant], variant, batch, args)
        medians = {}
        for variant in VARIANTS:
            steps = timers[variant].steps
            medians[variant] = (
                statistics.median(total for total, _ in steps) * 1e3,
                statistics.median(gemm for _, gemm in steps) * 1e3,
                statistics.median(total - gemm for total, gemm in steps) * 1e3,
            )
            kv = str(engines[variant].runner.kv_cache_dtype).removeprefix("torch.")
            step, gemm, rest = medians[variant]
            split = ["-", "-"] if variant == "stack" else [gemm, rest]  # its GEMMs run inside the C call
            rows.append([batch, variant, kv, step, *split, len(steps)])
        for baseline in ("reference", "layers"):
            rows.append(
                [batch, f"{baseline} / stack", "", medians[baseline][0] / medians["stack"][0], "", "", ""]
            )
    print_table(["batch", "variant", "KV cache", "step ms", "GEMM ms", "rest ms", "steps"], rows)


if __name__ == "__main__":
    main()
