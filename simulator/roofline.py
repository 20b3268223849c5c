"""Replica profiles derived from the roofline: a model's shapes and a GPU's nominal figures in, a
`ReplicaProfile` out, at tensor-parallel size N (one replica is one TP group of N GPUs on a node).

Per GPU, a step streams 1/N of the weights and of the KV it reads, does 1/N of the FLOPs, and then
waits for two all-reduces a layer (after the attention's o projection and the MLP's down
projection), each of batched tokens x hidden x 2 bytes, on a ring:

    all-reduce(bytes) = 2 (N - 1) / N x bytes / link bandwidth + per-collective latency

None of it is measured on more than one GPU: docs/simulator.md states the method and how to refit
the profiles from measured steps. `python -m kvasir.simulator.roofline --write simulator/profiles`
rewrites the shipped TP profiles from this module; `--check DIR` says whether they are current."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from kvasir.simulator.profile import PROFILES_DIR, ReplicaProfile, StepModel

# Assumptions shared by every derived profile (the TP=1 8B profile was made with the same ones).
MFU = 0.6  # the share of peak FLOP/s a large matrix product reaches
RESERVED_BYTES = 4e9  # per GPU: CUDA context, NCCL buffers, activations, CUDA graphs
KV_MEMORY_FRACTION = 0.9  # the runtime's --kv-cache-memory-fraction default
BASE_S = 0.0005  # per step on the host: scheduling, metadata, launch (rank 0 plans for all)
PER_SEQ_S = 18e-6  # per sequence in the step, host side
LOAD_BYTES_PER_S = 2e9  # reading the checkpoint at start-up (a node's NVMe or a PVC), all ranks
POD_START_S = 82.0  # pod start, image, CUDA init, warm-up: back-solved from the 8B's 90 s
TP_START_S = 10.0  # process group and NCCL communicators, once per pod with N > 1


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's shapes (Hugging Face config names in the comments)."""

    key: str
    name: str
    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    intermediate: int  # intermediate_size
    vocab: int  # vocab_size
    tied_embeddings: bool = False  # tie_word_embeddings
    dtype_bytes: int = 2  # bf16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, k, v, o
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # gate, up, down, norms
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * layer + embeddings + self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        return 2 * self.params  # a multiply and an add per weight (attention's own FLOPs left out)

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads are split across ranks; with fewer heads than ranks each rank keeps one copy."""
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV bytes one token takes on each rank (K and V, every layer)."""
        return self.layers * 2 * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Gpu:
    """A GPU's nominal figures (the datasheet's, not measured)."""

    key: str
    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    flops_per_s: float  # dense bf16
    link_bytes_per_s: float  # to the other GPUs of the node, per direction
    collective_latency_s: float  # one small all-reduce inside a node
    gpus_per_node: int = 8


LLAMA3_8B = ModelShape("llama3-8b", "Llama-3-8B", 32, 4096, 32, 8, 14336, 128256)
LLAMA3_70B = ModelShape("llama3-70b", "Llama-3-70B", 80, 8192, 64, 8, 28672, 128256)
H100 = Gpu("h100", "H100 SXM", 80e9, 3.35e12, 989e12, 450e9, 10e-6)
MODELS = {m.key: m for m in (LLAMA3_8B, LLAMA3_70B)}
GPUS = {g.key: g for g in (H100,)}
SHIPPED = [(model, H100, tp) for model in (LLAMA3_8B, LLAMA3_70B) for tp in (2, 4, 8)]


def allreduce_seconds(nbytes: float, tp: int, gpu: Gpu) -> float:
    """One ring all-reduce of `nbytes` over `tp` GPUs (none at TP=1)."""
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) / tp * nbytes / gpu.link_bytes_per_s + gpu.collective_latency_s


def profile_name(model: ModelShape, gpu: Gpu, tp: int) -> str:
    return f"{gpu.key}-{model.key}" + (f"-tp{tp}" if tp > 1 else "")


def _divides(model: ModelShape, tp: int) -> bool:
    return model.heads % tp == 0 and (model.kv_heads % tp == 0 or tp % model.kv_heads == 0)


def _fits(model: ModelShape, gpu: Gpu, tp: int) -> bool:
    return model.weight_bytes / tp + RESERVED_BYTES < gpu.memory_bytes


def check_tp(model: ModelShape, gpu: Gpu, tp: int) -> None:
    """ValueError saying why `model` cannot run at `tp` on `gpu`, and what would."""
    where = f"{model.name} at tensor-parallel size {tp} on {gpu.name}"
    if not 1 <= tp <= gpu.gpus_per_node:
        raise ValueError(f"{where}: the size must be 1 to {gpu.gpus_per_node} (one node)")
    if not _divides(model, tp):
        raise ValueError(
            f"{where}: {tp} must divide the {model.heads} attention heads, and divide or be a "
            f"multiple of the {model.kv_heads} KV heads"
        )
    if not _fits(model, gpu, tp):
        sizes = [
            n for n in range(tp + 1, gpu.gpus_per_node + 1) if _divides(model, n) and _fits(model, gpu, n)
        ]
        hint = f"the smallest size that fits is {sizes[0]}" if sizes else "no size on one node fits"
        raise ValueError(
            f"{where}: the weights do not fit: {model.weight_bytes / 1e9:.1f} GB in bf16, "
            f"{model.weight_bytes / tp / 1e9:.1f} GB per GPU plus {RESERVED_BYTES / 1e9:.0f} GB held "
            f"for the CUDA context and activations, against {gpu.memory_bytes / 1e9:.0f} GB; {hint}"
        )


def derive_profile(model: ModelShape, gpu: Gpu, tp: int, *, max_model_len: int = 8192) -> ReplicaProfile:
    """The roofline profile of one replica of `model` on `tp` GPUs; ValueError if it cannot run."""
    check_tp(model, gpu, tp)
    weights_per_gpu = model.weight_bytes / tp
    kv_per_token = model.kv_bytes_per_token(tp)
    block_size = 16
    kv_budget = KV_MEMORY_FRACTION * (gpu.memory_bytes - weights_per_gpu - RESERVED_BYTES)
    num_kv_blocks = int(kv_budget // (block_size * kv_per_token))
    if num_kv_blocks * block_size < max_model_len:
        raise ValueError(
            f"{model.name} at tensor-parallel size {tp} on {gpu.name}: the KV cache holds "
            f"{num_kv_blocks * block_size} tokens, fewer than max_model_len {max_model_len}"
        )
    token_bytes = model.hidden * model.dtype_bytes  # one token's activation, all-reduced
    collectives = 2 * model.layers
    latency = allreduce_seconds(0, tp, gpu)
    per_token = allreduce_seconds(token_bytes, tp, gpu) - latency  # the bandwidth term is linear
    step = StepModel(
        base_s=BASE_S,
        per_token_s=model.flops_per_token / tp / (MFU * gpu.flops_per_s),
        per_kv_token_s=kv_per_token / gpu.hbm_bytes_per_s,
        per_seq_s=PER_SEQ_S,
        weights_s=weights_per_gpu / gpu.hbm_bytes_per_s,
        allreduce_s=collectives * latency,
        allreduce_per_token_s=collectives * per_token,
    )
    replicated = f", {model.kv_heads} KV heads replicated to 1 a rank" if tp > model.kv_heads else ""
    share = f"1/{tp} of " if tp > 1 else ""
    on = f"{tp} {gpu.name} with tensor parallelism" if tp > 1 else f"one {gpu.name}"
    comm = (
        f"{collectives} ring all-reduces a step of tokens x {token_bytes} bytes at "
        f"{gpu.link_bytes_per_s / 1e9:.0f} GB/s plus {gpu.collective_latency_s * 1e6:.0f} us each; "
        if tp > 1
        else ""
    )
    description = (
        f"{model.name} (bf16, {model.weight_bytes / 1e9:.1f} GB) on {on}, from the roofline, not "
        f"measured: per GPU {weights_per_gpu / 1e9:.2f} GB of weights and {kv_per_token // 1024} "
        f"KiB/token of KV{replicated} at {gpu.hbm_bytes_per_s / 1e12:.2f} TB/s, {share}"
        f"{model.flops_per_token / 1e9:.0f} GFLOP/token at {MFU:.0%} of {gpu.flops_per_s / 1e12:.0f} "
        f"TFLOP/s; {comm}KV {KV_MEMORY_FRACTION} of what {gpu.memory_bytes / 1e9:.0f} GB leaves after "
        f"the weights and {RESERVED_BYTES / 1e9:.0f} GB; host {PER_SEQ_S * 1e6:.0f} us/sequence; "
        f"{tp} GPU-hour(s) an hour"
    )
    cold_start = POD_START_S + model.weight_bytes / LOAD_BYTES_PER_S + (TP_START_S if tp > 1 else 0.0)
    return ReplicaProfile(
        name=profile_name(model, gpu, tp),
        description=description,
        step=step,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        cold_start_s=round(cold_start, 1),
        gpus=tp,
    )


def shipped_text(profile: ReplicaProfile) -> str:
    return json.dumps(profile.to_json(), indent=2) + "\n"


def stale_profiles(directory: Path = PROFILES_DIR) -> list[str]:
    """The shipped TP profiles whose file differs from what this module derives."""
    stale = []
    for model, gpu, tp in SHIPPED:
        profile = derive_profile(model, gpu, tp)
        path = directory / f"{profile.name}.json"
        if not path.is_file() or path.read_text() != shipped_text(profile):
            stale.append(profile.name)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvasir.simulator.roofline",
        description="Derive a replica profile from the roofline (model shapes, GPU datasheet, ring all-reduce).",
    )
    parser.add_argument("model", nargs="?", choices=sorted(MODELS), help="print this model's profile as JSON")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs per replica)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--write", metavar="DIR", type=Path, help="rewrite the shipped TP profiles in DIR")
    parser.add_argument("--check", metavar="DIR", type=Path, help="exit 1 if a TP profile in DIR is stale")
    args = parser.parse_args(argv)
    if args.write:
        for model, gpu, tp in SHIPPED:
            profile = derive_profile(model, gpu, tp)
            (args.write / f"{profile.name}.json").write_text(shipped_text(profile))
        return 0
    if args.check:
        stale = stale_profiles(args.check)
        if stale:
            print(f"stale: {', '.join(stale)} (rewrite them with --write)", file=sys.stderr)
        return 1 if stale else 0
    if args.model is None:
        parser.error("name a model, or --write / --check")
    try:
        profile = derive_profile(MODELS[args.model], GPUS[args.gpu], args.tp)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(shipped_text(profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
