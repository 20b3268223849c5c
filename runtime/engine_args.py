"""Command-line flags for building an engine, shared by `kvasir generate` and `kvasir serve`.

The flags are `EngineConfig`'s settings (see `kvasir.runtime.settings`): each field's default,
choices and range are written once, on the field. Every flag can also be given as an environment
variable: `--max-model-len` is `KVASIR_MAX_MODEL_LEN` (the command line wins); that is how the
operator's pods and container images configure it. The operator's LLMDeployment parser and the CRD
(checked by a test) read the same table. This module and `config` import no torch.
"""

from __future__ import annotations

import argparse
import os

from kvasir.runtime.config import EMBEDDED_SERVED_NAME, ENGINE_FLAGS, EngineConfig
from kvasir.runtime.settings import Flag, add_flag, config_from_args, env_bool

EMBEDDED_MODEL = "embedded"

# Process settings that are flags but not part of the engine's configuration.
MODEL_FLAG = Flag(
    "--model",
    default=EMBEDDED_MODEL,
    help="Hugging Face folder, .gguf file, hub id (org/name, hf://org/name or "
    "hf://org/name/file.gguf); 'embedded' (default) is the bundled SmolLM2-135M-Instruct",
)
THREADS_FLAG = Flag(
    "--threads",
    type=int,
    minimum=1,
    maximum=1024,
    help="torch CPU threads (default: the CPUs this process may use; OMP_NUM_THREADS if set)",
)
# Switches read from the environment only, deep inside the kernels (kvasir.kernels.cpu_ops and
# runtime/models/cpu_decoder_stack.py; a test holds these names to theirs): checked at start-up,
# so a junk value is a one-line error before the model loads, not a traceback at the first step.
ENV_SWITCHES = ("KVASIR_CPU_KERNELS", "KVASIR_CPU_DECODER_STACK")
_BY_NAME = {flag.name: flag for flag in (MODEL_FLAG, *ENGINE_FLAGS, THREADS_FLAG)}


def engine_flag(name: str) -> Flag:
    """The definition of one engine flag (KeyError for an unknown name)."""
    return _BY_NAME[name]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine (each also readable from KVASIR_<FLAG>)")
    for flag in _BY_NAME.values():
        add_flag(group, flag)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig; raises ValueError with the flag's meaning on a bad value (or naming
    the variable of an unusable ENV_SWITCHES value)."""
    for name in ENV_SWITCHES:
        env_bool(name, True)
    embedded = args.model == EMBEDDED_MODEL
    model = args.model
    if embedded:
        from kvasir.runtime.loader.embedded import embedded_model_path

        model = str(embedded_model_path())
    return config_from_args(
        EngineConfig,
        args,
        model=model,
        hf_token=os.environ.get("HF_TOKEN"),
        served_model_name=args.served_model_name or (EMBEDDED_SERVED_NAME if embedded else None),
    )
