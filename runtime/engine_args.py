"""Command-line flags for building an engine, shared by `kvasir generate` and `kvasir serve`.

Every flag can also be given as an environment variable: `--max-model-len` is `KVASIR_MAX_MODEL_LEN`
(the command line wins). That is how the operator's pods and container images configure it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvasir.runtime.config import DEVICES, DTYPES, KV_CACHE_DTYPES, EngineConfig

EMBEDDED_MODEL = "embedded"


def _env_name(flag: str) -> str:
    return "KVASIR_" + flag.lstrip("-").replace("-", "_").upper()


def _env_true(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


def add_flag(
    parser: argparse.ArgumentParser, flag: str, *, type: Any = str, default: Any = None, **kw: Any
) -> None:
    """Add `flag` to `parser`; its `KVASIR_<FLAG>` environment variable, when set, is the default."""
    env = os.environ.get(_env_name(flag))
    if env is not None:
        default = type(env) if type is not bool else _env_true(env)
    parser.add_argument(flag, type=type, default=default, **kw)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine (each also readable from KVASIR_<FLAG>)")
    add_flag(
        group,  # type: ignore[arg-type]
        "--model",
        default=EMBEDDED_MODEL,
        help="Hugging Face folder, .gguf file or hub id; 'embedded' (default) is the bundled SmolLM2-135M-Instruct",
    )
    for flag, kwargs in _ENGINE_FLAGS:
        add_flag(group, flag, **kwargs)  # type: ignore[arg-type]
    prefix = os.environ.get(_env_name("--enable-prefix-caching"))
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=prefix is None or _env_true(prefix),
        help="reuse the KV of shared prompt prefixes (default: on)",
    )
    eager = os.environ.get(_env_name("--enforce-eager"))
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        default=eager is not None and _env_true(eager),
        help="never capture CUDA graphs; every step runs eagerly (default: graphs for decode steps on CUDA)",
    )


_ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--revision", {"help": "model revision (branch, tag or commit) for hub ids"}),
    ("--download-dir", {"help": "where hub downloads are cached (default: the Hugging Face cache)"}),
    ("--served-model-name", {"help": "the model name clients use (default: --model)"}),
    ("--dtype", {"default": "auto", "choices": DTYPES, "help": "auto: bfloat16 on CUDA, float32 on CPU"}),
    ("--device", {"default": "auto", "choices": DEVICES}),
    ("--seed", {"type": int, "default": 0, "help": "seed for requests that give none"}),
    ("--max-model-len", {"type": int, "help": "context length (default: the model's)"}),
    ("--block-size", {"type": int, "default": 16, "help": "tokens per KV-cache block"}),
    ("--num-kv-blocks", {"type": int, "help": "KV-cache blocks (overrides the memory budget)"}),
    ("--kv-cache-bytes", {"type": int, "default": 1 << 30, "help": "KV-cache byte budget on CPU"}),
    (
        "--kv-cache-memory-fraction",
        {"type": float, "default": 0.9, "help": "share of free GPU memory for the KV cache"},
    ),
    (
        "--kv-cache-dtype",
        {
            "default": "auto",
            "choices": KV_CACHE_DTYPES,
            "help": "auto: the model's dtype; fp8: float8 e4m3 (twice the tokens of a bf16 cache)",
        },
    ),
    ("--max-num-seqs", {"type": int, "default": 256, "help": "most requests running at once"}),
    ("--max-num-batched-tokens", {"type": int, "default": 2048, "help": "token budget per step"}),
    ("--scheduling-policy", {"default": "fcfs", "choices": ("fcfs", "priority")}),
]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; raises ValueError with the flag's meaning on a bad value."""
    model = args.model
    if model == EMBEDDED_MODEL:
        from kvasir.runtime.loader.embedded import embedded_model_path

        model = str(embedded_model_path())
    return EngineConfig(
        model=model,
        revision=args.revision,
        download_dir=args.download_dir,
        hf_token=os.environ.get("HF_TOKEN"),
        served_model_name=args.served_model_name
        or ("SmolLM2-135M-Instruct" if args.model == EMBEDDED_MODEL else None),
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        enforce_eager=args.enforce_eager,
    )
