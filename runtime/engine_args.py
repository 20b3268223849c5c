"""Command-line flags for building an engine, shared by `kvasir generate` and `kvasir serve`.

Every flag can also be given as an environment variable: `--max-model-len` is `KVASIR_MAX_MODEL_LEN`
(the command line wins). That is how the operator's pods and container images configure it.

`ENGINE_FLAGS` is the one definition of each flag's default, choices and range: the argument
parser enforces them, and the operator (its LLMDeployment parser and the CRD, checked by a test)
reads them from here. This module and `config` import no torch, so the operator can.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvasir.runtime.config import (
    BLOCK_SIZES,
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    SCHEDULING_POLICIES,
    EngineConfig,
)

EMBEDDED_MODEL = "embedded"
EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"


def env_name(flag: str) -> str:
    return "KVASIR_" + flag.lstrip("-").replace("-", "_").upper()


def _env_true(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Flag:
    """One flag: its type, default, allowed values or range, and help."""

    name: str
    type: Callable[[str], Any] = str
    default: Any = None
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    help: str = ""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def check(self, value: Any) -> Any:
        """`value` if it is allowed, else ValueError naming the flag and the rule."""
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(str(c) for c in self.choices)
            raise ValueError(f"{self.name} must be one of {allowed}, got {value!r}")
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            if high is None:
                raise ValueError(f"{self.name} must be at least {low:g}, got {value}")
            if low is None:
                raise ValueError(f"{self.name} must be at most {high:g}, got {value}")
            raise ValueError(f"{self.name} must be between {low:g} and {high:g}, got {value}")
        return value

    def parse(self, text: str) -> Any:
        """argparse's `type`: convert and check one command-line value."""
        try:
            return self.check(self.type(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("--revision", help="model revision (branch, tag or commit) for hub ids"),
    Flag("--download-dir", help="where hub downloads are cached (default: the Hugging Face cache)"),
    Flag(
        "--served-model-name",
        help=f"the model name clients use (default: --model; '{EMBEDDED_SERVED_NAME}' for embedded)",
    ),
    Flag("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on CUDA, float32 on CPU"),
    Flag("--device", default="auto", choices=DEVICES, help="auto: CUDA when available"),
    Flag("--seed", type=int, default=0, minimum=0, help="seed for requests that give none"),
    Flag("--max-model-len", type=int, minimum=1, help="context length (default: the model's)"),
    Flag("--block-size", type=int, default=16, choices=BLOCK_SIZES, help="tokens per KV-cache block"),
    Flag("--num-kv-blocks", type=int, minimum=1, help="KV-cache blocks (overrides the memory budget)"),
    Flag("--kv-cache-bytes", type=int, default=1 << 30, minimum=1, help="KV-cache byte budget on CPU"),
    Flag(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.9,
        minimum=0.01,
        maximum=0.98,
        help="share of the GPU memory left free after loading the weights that the KV cache takes",
    ),
    Flag(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; fp8: float8 e4m3 (twice the tokens of a bf16 cache)",
    ),
    Flag(
        "--max-num-seqs",
        type=int,
        default=256,
        minimum=1,
        maximum=65536,
        help="most requests running at once",
    ),
    Flag(
        "--max-num-batched-tokens",
        type=int,
        minimum=1,
        maximum=10_000_000,
        help="token budget per step (default: 8192 on CUDA, 2048 on CPU)",
    ),
    Flag("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES),
    Flag(
        "--threads",
        type=int,
        minimum=1,
        maximum=1024,
        help="torch CPU threads (default: the CPUs this process may use, less one; OMP_NUM_THREADS if set)",
    ),
)

_BY_NAME = {flag.name: flag for flag in ENGINE_FLAGS}


def engine_flag(name: str) -> Flag:
    """The definition of one engine flag (KeyError for an unknown name)."""
    return _BY_NAME[name]


def add_flag(parser: argparse.ArgumentParser, flag: Flag) -> None:
    """Add `flag` to `parser`; its `KVASIR_<FLAG>` environment variable, when set, is the default."""
    # argparse converts (and checks) a string default as if it had been given on the command line.
    default = os.environ.get(env_name(flag.name), flag.default)
    help_text = flag.help
    if flag.default is not None and "default" not in help_text:
        help_text = f"{help_text} (default: %(default)s)".lstrip()
    parser.add_argument(flag.name, type=flag.parse, default=default, help=help_text, metavar=_metavar(flag))


def _metavar(flag: Flag) -> str | None:
    if flag.choices is not None:
        return "{" + ",".join(str(c) for c in flag.choices) + "}"
    return None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine (each also readable from KVASIR_<FLAG>)")
    add_flag(
        group,  # type: ignore[arg-type]
        Flag(
            "--model",
            default=EMBEDDED_MODEL,
            help="Hugging Face folder, .gguf file, hub id (org/name, hf://org/name or "
            "hf://org/name/file.gguf); 'embedded' (default) is the bundled SmolLM2-135M-Instruct",
        ),
    )
    for flag in ENGINE_FLAGS:
        add_flag(group, flag)  # type: ignore[arg-type]
    prefix = os.environ.get(env_name("--enable-prefix-caching"))
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=prefix is None or _env_true(prefix),
        help="reuse the KV of shared prompt prefixes (default: on)",
    )
    eager = os.environ.get(env_name("--enforce-eager"))
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        default=eager is not None and _env_true(eager),
        help="never capture CUDA graphs; every step runs eagerly (default: graphs for decode steps on CUDA)",
    )


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
        or (EMBEDDED_SERVED_NAME if args.model == EMBEDDED_MODEL else None),
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
