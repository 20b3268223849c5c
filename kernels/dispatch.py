"""Which implementation of an op runs: the Triton kernel on CUDA, the plain-torch reference elsewhere.

`KVASIR_KERNELS` overrides the choice for the whole process: `triton` forces the kernels (on CPU
tensors that needs Triton's interpreter, `TRITON_INTERPRET=1`; the test suite runs them that way),
`torch` forces the references (for A/B comparisons on a GPU), `auto` or unset picks by device.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKEND_ENV = "KVASIR_KERNELS"
BACKENDS = ("auto", "triton", "torch")


def requested_backend() -> str:
    """The value of `KVASIR_KERNELS`, checked: one of `BACKENDS`."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its numpy interpreter (read by Triton when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """True when the op on tensors of `device` should run the Triton kernel."""
    backend = requested_backend()
    if backend == "torch":
        return False
    if backend == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError(f"{BACKEND_ENV}=triton but the `triton` package is not installed")
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"{BACKEND_ENV}=triton on {device.type} tensors needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 (before the kernels are imported) or use CUDA tensors"
        )
    return True
