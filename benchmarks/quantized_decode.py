"""The decode step of a Llama-3-8B-shaped model on a GPU: bf16 weights against AWQ int4 and FP8, in
the same run, same random weights' shapes (no checkpoint, nothing from a model hub).

Each model is Kvasir's own (`LlamaForCausalLM` built as a quantized model loads: packed
`QuantizedWeight`s handed to `load_weights`), with every decoder projection quantized and the
embedding and LM head in bf16, as AWQ checkpoints and vLLM's FP8 leave them:

- `bf16`: the float model;
- `awq-int4`: AWQ tensors (`qweight`/`qzeros`/`scales`, groups of 128) of random codes, read by
  Kvasir's AWQ reader and run by its Triton int4 kernel;
- `fp8`: the bf16 weights quantized at load (`--quantization fp8`: per-row scales), run by
  `torch._scaled_mm` with per-token activation scales.

A step is the model's forward pass for `batch` decoding requests, each with `--context` tokens
in a paged KV cache (bf16, block size 16), replayed from the CUDA graph Kvasir's model runner
captures (`DecodeGraphRunner`); the sampler is not included. Median of `--iters` replays.
Goals: awq-int4 >= 2x bf16 at batch 1; fp8 >= 1.6x bf16 at batch 64.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_header, print_table
from _gpu import cuda_time_ms, gpu_lines
from _random_model import SHAPES, SMOKE_SHAPES, RandomWeights

METHODS = ("bf16", "awq-int4", "fp8")
GOALS = {("awq-int4", 1): 2.0, ("fp8", 64): 1.6}
GROUP_SIZE = 128
BLOCK_SIZE = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in PROJECTIONS


def awq_weights(source: RandomWeights, group_size: int) -> Iterator[tuple[str, Any]]:
    """The float weights, with every projection replaced by AWQ tensors of random codes."""
    import torch

    from kvasir.runtime.layers.quantization.awq import AwqWeight

    g = torch.Generator(device=source.device).manual_seed(source.seed)
    for name, tensor in source.iter_weights():
        if not is_projection(name):
            yield name, tensor
            continue
        out_features, in_features = tensor.shape
        del tensor
        groups = in_features // group_size
        device = source.device
        yield (
            name,
            AwqWeight(
                {
                    "qweight": torch.randint(
                        -(2**31),
                        2**31 - 1,
                        (in_features, out_features // 8),
                        generator=g,
                        device=device,
                        dtype=torch.int32,
                    ),
                    "qzeros": torch.randint(
                        -(2**31),
                        2**31 - 1,
                        (groups, out_features // 8),
                        generator=g,
                        device=device,
                        dtype=torch.int32,
                    ),
                    "scales": (
                        torch.rand(groups, out_features, generator=g, device=device) * 0.004 + 0.001
                    ).half(),
                },
                group_size,
            ),
        )


def build(method: str, shape: Any, device: Any, seed: int) -> Any:
    import torch

    from kvasir.runtime.layers.quantization.fp8_linear import online_fp8_weight
    from kvasir.runtime.loader.hf_config import model_config_from_hf
    from kvasir.runtime.models.registry import get_model_class

    config = model_config_from_hf(shape.hf_config().to_dict(), source=f"<{shape.label}>")
    quantization = {"bf16": None, "awq-int4": "awq", "fp8": "fp8"}[method]
    source = RandomWeights(config, device, torch.bfloat16, seed)  # names of the float model
    config = dataclasses.replace(config, quantization=quantization)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = get_model_class(config.architecture)(config)
        finally:
            torch.set_default_dtype(previous)
    group_size = min(GROUP_SIZE, shape.hidden_size)
    weights = awq_weights(source, group_size) if method == "awq-int4" else source.iter_weights()
    model.load_weights(weights, online_fp8_weight if method == "fp8" else None)
    return model.eval()


def kv_caches_for(model: Any, batch: int, context: int, device: Any) -> list[tuple[Any, Any]]:
    import torch

    config = model.config
    num_blocks = batch * -(-(context + 1) // BLOCK_SIZE) + 1
    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.randn(shape, dtype=torch.bfloat16, device=device),
            torch.randn(shape, dtype=torch.bfloat16, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


def decode_batch(batch: int, context: int, vocab_size: int, device: Any) -> tuple[Any, Any, Any]:
    """(input ids, positions, attention metadata) of `batch` requests decoding after `context`
    tokens each, in blocks of their own (block 0 is left unused)."""
    import torch

    from kvasir.runtime.layers.attention import AttentionMetadata

    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    table = (
        torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).reshape(batch, blocks_per_seq)
        + 1
    )
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    attn = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=table[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE,
        max_query_len=1,
        max_seq_len=context + 1,
    )
    return torch.randint(0, vocab_size, (batch,), device=device), positions, attn


def decode_step_ms(model: Any, batches: list[int], context: int, device: Any, iters: int) -> dict[int, float]:
    """Median ms of one graph-replayed decode step at each batch size."""
    from kvasir.kernels import AttentionWorkspace
    from kvasir.kernels.workspace import MAX_DECODE_SPLITS
    from kvasir.runtime.worker.cuda_graphs import DecodeGraphRunner

    config = model.config
    largest = max(batches)
    workspace = AttentionWorkspace(
        largest, config.num_attention_heads, config.head_dim, MAX_DECODE_SPLITS, device
    )
    graphs = DecodeGraphRunner(
        model,
        kv_caches_for(model, largest, context, device),
        max_batch_size=largest,
        max_model_len=context + 1,
        block_size=BLOCK_SIZE,
        workspace=workspace,
        device=device,
    )
    results = {}
    for batch in batches:
        ids, positions, attn = decode_batch(batch, context, config.vocab_size, device)
        results[batch] = cuda_time_ms(
            lambda ids=ids, positions=positions, attn=attn: graphs.run(ids, positions, attn),
            warmup=3,
            iters=iters,
        )
    return results


def weight_gib(model: Any) -> float:
    from kvasir.runtime.layers.quantization.report import weights_report

    return weights_report(model, model.config.quantization).weight_bytes / 2**30


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: checks the script runs")
    args = parser.parse_args(argv)
    import torch

    print_header("Decode step: bf16 vs AWQ int4 vs FP8, Llama-3-8B-shaped", argv or sys.argv[1:])
    for line in gpu_lines():
        print(line)
    if args.smoke or not torch.cuda.is_available():
        print("smoke run (no GPU): builds each model and runs one decode step eagerly, no timings")
        shape, cpu = SMOKE_SHAPES["llama3-8b"], torch.device("cpu")
        for method in args.methods:
            model = build(method, shape, cpu, seed=0)
            ids, positions, attn = decode_batch(2, 20, shape.vocab_size, cpu)
            with torch.inference_mode():
                hidden = model(ids, positions, kv_caches_for(model, 2, 20, cpu), attn)
            assert bool(hidden.isfinite().all())
            print(
                f"{method}: {weight_gib(model) * 2**10:.2f} MiB of weights, {model.lm_head.describe()[0]}; step ran"
            )
        return
    device = torch.device("cuda")
    shape = SHAPES["llama3-8b"]
    rows, baseline, verdicts = [], {}, []
    for method in args.methods:
        started = time.perf_counter()
        model = build(method, shape, device, seed=0)
        built_s = time.perf_counter() - started
        gib = weight_gib(model)
        print(f"{method}: down_proj runs {model.model.layers[0].mlp.down_proj.describe()[0]}", flush=True)
        times = decode_step_ms(model, args.batch, args.context, device, args.iters)
        for batch, ms in times.items():
            if method == "bf16":
                baseline[batch] = ms
            speedup = baseline[batch] / ms if batch in baseline else float("nan")
            rows.append([method, batch, ms, speedup, batch * 1e3 / ms, gib, built_s])
            goal = GOALS.get((method, batch))
            if goal is not None and batch in baseline:
                verdicts.append(
                    f"{method} at batch {batch}: {speedup:.2f}x bf16 (goal >= {goal}x): {'MET' if speedup >= goal else 'NOT MET'}"
                )
        del model
        gc.collect()
        torch.cuda.empty_cache()
    print(
        f"context {args.context} tokens per request, bf16 KV cache, CUDA-graph replays (median of {args.iters})"
    )
    print_table(["weights", "batch", "ms/step", "vs bf16", "tokens/s", "weights GiB", "load s"], rows)
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
