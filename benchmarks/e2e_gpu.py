"""End to end on one GPU: Kvasir against `transformers.generate` (static batches), same random weights.

Models: Qwen3-0.6B-shaped and Llama-3-8B-shaped (the real configs, llama3 rope scaling, Qwen3's q/k
norm and tied embeddings), random bf16 weights made on the GPU and loaded into both engines
(no checkpoint on disk). Workload: 256 requests, prompts of uniform 100-1024 random token ids,
outputs uniform 100-1024 tokens, EOS ignored, greedy, fixed seed.

Kvasir: every request submitted at once; output tokens / wall time from the first submission to
the last token. Hugging Face: left-padded static batches in submission order; each batch runs
until its longest request is done (`min_new_tokens = max_new_tokens` = that longest output), and
only each request's own output tokens count. If its batches would run past `--hf-max-seconds`,
the later ones are left out and its tokens/s is over the batches it ran (printed).

Decode roofline: every decode-only step at the largest batch (256) is timed (`engine.step()` and
the model runner inside it); roofline = (weight bytes + KV bytes that step reads) / peak HBM
bandwidth, with weight bytes = every parameter except an untied input embedding (a decode reads
only 256 rows of it) and KV bytes = K and V of every context token in every layer.
Goals: Kvasir >= 10x Hugging Face's output tokens/s; decode step <= 1.5x its roofline.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import EOS_ID, FIRST_PLAIN_ID, PAD_ID, print_header, print_table
from _gpu import gpu_lines, peak_bandwidth_bytes_per_s
from _random_model import (
    SHAPES,
    SMOKE_SHAPES,
    ModelShape,
    RandomWeights,
    hf_model_with_weights,
    random_model_files,
)
from continuous_vs_static import Workload, make_workload

THROUGHPUT_GOAL = 10.0
ROOFLINE_GOAL = 1.5


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    kv_tokens: int  # context tokens the step attends over, summed over requests
    step_s: float  # engine.step()
    runner_s: float  # the model runner's execute() inside it


@dataclass
class KvasirRun:
    setup_s: float
    wall_s: float
    output_tokens: int
    preemptions: int
    num_blocks: int
    cuda_graphs: bool
    weight_bytes: int
    kv_bytes_per_token: int
    decode_steps: list[DecodeStep]
    first_tokens: dict[int, int]


@dataclass
class HFRun:
    wall_s: float = 0.0
    requests: int = 0
    output_tokens: int = 0  # useful: each request's own output length
    generated_tokens: int = 0  # what the batches generated, padding rows included
    first_tokens: dict[int, int] = field(default_factory=dict)


def engine_config(args: argparse.Namespace, device: Any, dtype_name: str) -> Any:
    """Engine settings for 256 concurrent requests on one 80 GB GPU.

    max_num_seqs 256: every request runs at once. max_num_batched_tokens 8192: a prompt chunk big
    enough to keep the tensor cores busy, small enough that the activations of a step stay under
    2 GB for an 8B model. KV cache: 0.85 of the memory left after the weights (the rest holds the
    activations, the CUDA graphs and the sampler); for 8B that is ~50 GB, ~400k tokens, twice the
    ~180k the default workload holds at its peak (no preemption).
    """
    from kvasir.runtime.config import EngineConfig

    return EngineConfig(
        model="random-weights",
        device=device.type,
        dtype=dtype_name,
        seed=args.seed,
        max_model_len=args.max_prompt + args.max_output,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_bytes=256 << 20,  # CPU (smoke) only
    )


def run_kvasir(
    files: Any, workload: Workload, args: argparse.Namespace, device: Any, dtype_name: str
) -> KvasirRun:

    from kvasir.runtime.engine.llm_engine import LLMEngine
    from kvasir.runtime.sample.params import SamplingParams

    started = time.perf_counter()
    engine = LLMEngine(engine_config(args, device, dtype_name), files)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate(
        [[FIRST_PLAIN_ID] * args.max_prompt, [FIRST_PLAIN_ID + 1] * 7, [FIRST_PLAIN_ID + 2] * 3], warm
    )
    _sync(device)
    setup_s = time.perf_counter() - started

    # Every finished step passes through _complete, with async scheduling (the default on CUDA,
    # where steps are planned ahead and never go through scheduler.schedule/runner.execute in
    # order) and without: it sees the plan that ran and the runner's time for it. Only the latest
    # is kept (1,000+ plans of 256 block tables add up).
    completed: list[Any] = [None, 0.0]  # plan, runner seconds
    completions = [0]
    complete = engine._complete

    def recording_complete(plan: Any, result: Any) -> None:
        completed[0], completed[1] = plan, result.duration_s
        completions[0] += 1
        complete(plan, result)

    engine._complete = recording_complete  # type: ignore[method-assign]
    preemptions_before = engine.stats().num_preemptions

    decode_steps: list[DecodeStep] = []
    first_tokens: dict[int, int] = {}
    generated = 0
    started = time.perf_counter()
    for index, (prompt, output_len) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        engine.add_request(str(index), params=params, prompt_token_ids=prompt)
    while engine.has_unfinished():
        before = completions[0]
        step_started = time.perf_counter()
        outputs = engine.step()
        # With async scheduling this is the period between two finished steps (the next one is
        # already queued), which is what a decode step costs in steady state.
        step_s = time.perf_counter() - step_started
        if completions[0] > before and all(item.num_tokens == 1 for item in completed[0].scheduled):
            scheduled = completed[0].scheduled
            kv_tokens = sum(item.start + 1 for item in scheduled)
            decode_steps.append(DecodeStep(len(scheduled), kv_tokens, step_s, completed[1]))
        for output in outputs:
            for choice in output.outputs:
                if choice.token_ids and int(output.request_id) not in first_tokens:
                    first_tokens[int(output.request_id)] = choice.token_ids[0]
                generated += len(choice.token_ids)
    wall_s = time.perf_counter() - started
    expected = sum(workload.output_lens)
    if generated != expected:
        raise RuntimeError(f"Kvasir generated {generated} tokens, expected {expected}")

    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not files.config.tie_word_embeddings:
        embedding = model.get_parameter("model.embed_tokens.weight")
        weight_bytes -= embedding.numel() * embedding.element_size()
    element_size = engine.runner.kv_cache_dtype.itemsize
    run = KvasirRun(
        setup_s=setup_s,
        wall_s=wall_s,
        output_tokens=generated,
        preemptions=engine.stats().num_preemptions - preemptions_before,
        num_blocks=engine.runner.num_blocks,
        cuda_graphs=getattr(engine.runner, "decode_graphs", None) is not None,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=files.config.kv_elements_per_token * element_size,
        decode_steps=decode_steps,
        first_tokens=first_tokens,
    )
    return run  # the caller frees the engine's memory once this frame (and the engine) is gone


def run_hf(shape: ModelShape, weights: RandomWeights, workload: Workload, args: argparse.Namespace) -> HFRun:
    """`transformers.generate` over left-padded static batches until `--hf-max-seconds` would pass."""

    model = hf_model_with_weights(shape, weights)
    device = weights.device
    _generate(model, [[FIRST_PLAIN_ID] * 8, [FIRST_PLAIN_ID + 1] * 5], 4, device)  # warm-up
    run = HFRun()
    indices = list(range(len(workload.prompts)))
    batches = [indices[i : i + args.hf_batch_size] for i in range(0, len(indices), args.hf_batch_size)]
    for number, batch in enumerate(batches, 1):
        last_batch_s = run.wall_s / max(1, number - 1)
        if run.requests and run.wall_s + last_batch_s > args.hf_max_seconds:
            print(f"  transformers: stopping after {number - 1} of {len(batches)} batches (--hf-max-seconds)")
            break
        longest = max(workload.output_lens[i] for i in batch)
        started = time.perf_counter()
        out, prompt_len = _generate(model, [workload.prompts[i] for i in batch], longest, device)
        run.wall_s += time.perf_counter() - started
        if out.shape[1] != prompt_len + longest:
            raise RuntimeError(f"transformers generated {out.shape[1] - prompt_len} tokens, not {longest}")
        run.requests += len(batch)
        run.output_tokens += sum(workload.output_lens[i] for i in batch)
        run.generated_tokens += len(batch) * longest
        for row, index in enumerate(batch):
            run.first_tokens[index] = int(out[row, prompt_len])
        print(
            f"  transformers batch {number}/{len(batches)}: {len(batch)} requests, "
            f"{longest} steps, {run.wall_s:.0f}s so far",
            flush=True,
        )
    del model
    _free(device)
    return run


def _generate(model: Any, prompts: list[list[int]], new_tokens: int, device: Any) -> tuple[Any, int]:
    """Greedy `generate` of exactly `new_tokens` tokens per row; returns (ids, padded prompt length)."""
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), PAD_ID, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
        )
    _sync(device)
    return out, longest


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Summary:
    label: str
    kvasir_tps: float
    hf_tps: float | None
    roofline_ratio: float | None


def run_model(key: str, args: argparse.Namespace, device: Any) -> Summary:
    import torch

    shape = (SMOKE_SHAPES if args.smoke else SHAPES)[key]
    dtype, dtype_name = (torch.float32, "float32") if args.smoke else (torch.bfloat16, "bfloat16")
    files = random_model_files(shape, device, dtype, args.seed)
    workload = make_workload(args, shape.vocab_size)
    print(
        f"== {shape.label}: {_count(files.weights.num_parameters)} random parameters ({dtype_name}), "
        f"hidden {shape.hidden_size}, {shape.num_layers} layers, {shape.num_heads}/{shape.num_kv_heads} heads, "
        f"vocab {shape.vocab_size}"
    )
    print(
        f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, outputs "
        f"{args.min_output}-{args.max_output} (uniform, EOS ignored, greedy); {sum(workload.output_lens)} "
        f"output tokens",
        flush=True,
    )
    kvasir = run_kvasir(files, workload, args, device, dtype_name)
    _free(device)  # the engine (weights, KV cache, CUDA graphs) before transformers loads
    kvasir_tps = kvasir.output_tokens / kvasir.wall_s
    print(
        f"Kvasir: set up in {kvasir.setup_s:.0f}s ({kvasir.num_blocks} KV blocks = "
        f"{kvasir.num_blocks * args.block_size} tokens, CUDA graphs {'on' if kvasir.cuda_graphs else 'off'}, "
        f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}); "
        f"ran in {kvasir.wall_s:.1f}s, {kvasir.preemptions} preemptions",
        flush=True,
    )
    hf = None if args.skip_hf else run_hf(shape, files.weights, workload, args)

    rows = [["Kvasir (all at once)", args.num_requests, kvasir.output_tokens, "-", kvasir.wall_s, kvasir_tps]]
    hf_tps = None
    if hf is not None:
        hf_tps = hf.output_tokens / hf.wall_s
        rows.append(
            [
                f"transformers (static, batch {args.hf_batch_size})",
                hf.requests,
                hf.output_tokens,
                hf.generated_tokens,
                hf.wall_s,
                hf_tps,
            ]
        )
    print_table(
        ["engine", "requests", "output tokens", "generated incl. padding", "wall s", "output tok/s"], rows
    )
    if hf is not None and hf_tps:
        subset = (
            ""
            if hf.requests == args.num_requests
            else f" (transformers over its first {hf.requests} requests)"
        )
        verdict = "ok" if kvasir_tps / hf_tps >= THROUGHPUT_GOAL else "MISS"
        verdict = "not judged (CPU smoke)" if args.smoke else verdict
        print(
            f"Kvasir / transformers output tok/s: {kvasir_tps / hf_tps:.1f}x{subset}; goal >= 10x: {verdict}"
        )
        same = sum(kvasir.first_tokens.get(i) == token for i, token in hf.first_tokens.items())
        print(
            f"first generated token equal in both engines: {same}/{len(hf.first_tokens)} requests "
            "(a check that both run the same weights; bf16 near-ties may differ)"
        )
    ratio = report_decode(kvasir, args, device)
    print()
    return Summary(shape.label, kvasir_tps, hf_tps, ratio)


def report_decode(run: KvasirRun, args: argparse.Namespace, device: Any) -> float | None:
    """The decode steps at the largest decode batch against their roofline; the median ratio or None."""
    import torch

    if not run.decode_steps:
        print("no decode-only step was recorded")
        return None
    batch = max(step.batch for step in run.decode_steps)
    steps = [step for step in run.decode_steps if step.batch == batch]
    peak = peak_bandwidth_bytes_per_s(torch.cuda.get_device_name()) if device.type == "cuda" else None
    kv_bytes = statistics.median(step.kv_tokens * run.kv_bytes_per_token for step in steps)
    step_ms = statistics.median(step.step_s for step in steps) * 1e3
    runner_ms = statistics.median(step.runner_s for step in steps) * 1e3
    roofline_ms = (run.weight_bytes + kv_bytes) / peak * 1e3 if peak else None
    ratio = statistics.median(
        step.step_s / ((run.weight_bytes + step.kv_tokens * run.kv_bytes_per_token) / peak) for step in steps
    ) if peak else None  # fmt: skip
    print_table(
        [
            "decode batch",
            "steps",
            "weight GB",
            "KV GB read",
            "roofline ms",
            "engine.step ms",
            "runner ms",
            "step / roofline",
            "runner / roofline",
        ],
        [
            [
                batch,
                len(steps),
                run.weight_bytes / 1e9,
                kv_bytes / 1e9,
                roofline_ms if roofline_ms else "-",
                step_ms,
                runner_ms,
                ratio if ratio else "-",
                runner_ms / roofline_ms if roofline_ms else "-",
            ]
        ],
    )
    if batch != args.max_num_seqs:
        print(f"(no decode-only step ran at batch {args.max_num_seqs}; these are the largest, batch {batch})")
    if ratio is not None:
        verdict = "ok" if ratio <= ROOFLINE_GOAL else "MISS"
        print(
            f"decode step / roofline (median over steps): {ratio:.2f}x; goal <= {ROOFLINE_GOAL}x: {verdict}"
        )
    return ratio


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["qwen3-0.6b", "llama3-8b", "both"], default="both")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--min-output", type=int, default=100)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=0.85)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: twice the KV blocks of bf16"
    )
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of transformers")
    parser.add_argument(
        "--hf-max-seconds",
        type=float,
        default=240.0,
        help="transformers runs no further batch once it would pass this (its tokens/s is over those it ran)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="Kvasir only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models of the same architectures on CPU (float32, torch reference kernels), 8 short requests",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.num_requests, args.min_prompt, args.max_prompt = 8, 5, 40
        args.min_output, args.max_output, args.hf_batch_size = 3, 24, 4
        args.max_num_seqs, args.max_num_batched_tokens = 8, 64
    for name in ("num_requests", "min_prompt", "min_output", "hf_batch_size", "max_num_seqs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        parser.error("each --min-* must be at most its --max-*")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU (use --smoke for a tiny CPU run)")
    device = torch.device("cpu" if args.smoke else "cuda")
    torch.manual_seed(args.seed)
    print_header("end to end on one GPU: Kvasir vs transformers.generate")
    for line in gpu_lines():
        print(line)
    print()
    keys = ["qwen3-0.6b", "llama3-8b"] if args.model == "both" else [args.model]
    summaries = [run_model(key, args, device) for key in keys]
    print_table(
        [
            "model",
            "Kvasir tok/s",
            "transformers tok/s",
            "ratio (goal >= 10)",
            "decode step / roofline (goal <= 1.5)",
        ],
        [
            [
                s.label,
                s.kvasir_tps,
                s.hf_tps if s.hf_tps else "-",
                s.kvasir_tps / s.hf_tps if s.hf_tps else "-",
                s.roofline_ratio if s.roofline_ratio else "-",
            ]
            for s in summaries
        ],
    )
    if args.smoke:
        print("CPU smoke run: the script works end to end; these are not GPU figures and no goal is judged.")


if __name__ == "__main__":
    main()
