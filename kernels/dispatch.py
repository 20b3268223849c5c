"""Which implementation of an op runs: the Triton kernel on CUDA, the plain-torch reference elsewhere.

`KVASIR_KERNELS` overrides the choice for the whole process: `triton` forces the kernels (on CPU
tensors that needs Triton's interpreter, `TRITON_INTERPRET=1`; the test suite runs them that way),
`torch` forces the references (for A/B comparisons on a GPU), `auto` or unset picks by device.

The choice is made once per device type, when the model runner starts (`choose_backend`), or at the
first op otherwise, and then kept: the ops on the hot path do not consult the environment, and a
misconfiguration fails at start-up rather than inside a request. `reset_backend_choice` forgets it
(tests that switch backends call it).
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


_chosen: dict[str, bool] = {}  # device type -> whether its ops run the Triton kernels


def use_triton(device: torch.device) -> bool:
    """True when the op on tensors of `device` should run the Triton kernel."""
    chosen = _chosen.get(device.type)
    return chosen if chosen is not None else choose_backend(device)


def choose_backend(device: torch.device) -> bool:
    """Decide (from `KVASIR_KERNELS`) and remember whether ops on `device` run Triton; raises for a
    setting that cannot work there."""
    _chosen[device.type] = _resolve(device)
    return _chosen[device.type]


def reset_backend_choice() -> None:
    """Forget the choices, so the next op (or `choose_backend`) reads the environment again."""
    _chosen.clear()


def _resolve(device: torch.device) -> bool:
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
