"""`KVASIR_KERNELS` picks the implementation of the elementwise ops, and the model layers go through it.

The choice is made once and kept (tests/conftest.py forgets it between tests); a test that switches
backends midway calls `reset_backend_choice`. Without a
GPU, `auto` means the reference and Triton runs in the interpreter (tests/conftest.py); with one,
the tensors live on it and `auto` means Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import kvasir.kernels as kernels
from kvasir.kernels.cpu_ops import rms_norm as cpu_rms_norm
from kvasir.kernels.dispatch import choose_backend, reset_backend_choice, use_triton
from kvasir.runtime.layers.mlp import GatedMLP
from kvasir.runtime.layers.norm import RMSNorm
from kvasir.runtime.layers.rotary import RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class Op:
    name: str  # the function's name in kvasir.kernels, the reference module and the Triton module
    module: str  # kvasir.kernels.reference.<module> and kvasir.kernels.triton_ops.<module>
    args: Callable[[torch.device], tuple[Any, ...]]  # the arguments, on the given device


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
AUTO = "triton_ops" if DEVICE.type == "cuda" else "reference"


def _x(*shape: int, device: torch.device = DEVICE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(device)


def _angles(device: torch.device = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    table = RotaryEmbedding(8, max_position=16, base=10000.0).to(device)
    return table(torch.tensor([0, 3, 7], device=device))


OPS = [
    Op("rms_norm", "norm", lambda d: (_x(3, 8, device=d), _x(8, device=d), 1e-6)),
    Op(
        "fused_add_rms_norm",
        "norm",
        lambda d: (_x(3, 8, device=d), _x(3, 9, device=d)[:, :8], _x(8, device=d), 1e-6),
    ),
    Op("apply_rotary", "rotary", lambda d: (_x(3, 2, 8, device=d), *_angles(d))),
    Op("silu_and_mul", "activation", lambda d: (_x(3, 8, device=d), _x(4, 8, device=d)[:3])),
]


def spy(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> list[tuple[Any, ...]]:
    """Record the calls of `module.name`, still running the real function."""
    target = importlib.import_module(module)
    real = getattr(target, name)
    calls: list[tuple[Any, ...]] = []

    def recording(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(target, name, recording)
    return calls


@pytest.mark.parametrize(
    ("backend", "chosen"), [("torch", "reference"), ("auto", AUTO), ("triton", "triton_ops")]
)
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_backend_choice(op: Op, backend: str, chosen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_KERNELS", backend)
    # Without Triton, float32 norms on CPU go to the C kernel (tests/kernels/test_rms_norm_cpu.py);
    # turned off here, this test sees the Triton-or-reference choice alone.
    monkeypatch.setattr(cpu_rms_norm, "supports", lambda *args: False)
    reference_calls = spy(monkeypatch, f"kvasir.kernels.reference.{op.module}", op.name)
    triton_calls = spy(monkeypatch, f"kvasir.kernels.triton_ops.{op.module}", op.name)
    args = op.args(DEVICE)
    result = getattr(kernels, op.name)(*args)
    assert (len(reference_calls), len(triton_calls)) == ((1, 0) if chosen == "reference" else (0, 1))
    # Whichever ran, the result is the reference's (within the kernels' tested tolerances).
    monkeypatch.setenv("KVASIR_KERNELS", "torch")
    reset_backend_choice()
    torch.testing.assert_close(result, getattr(kernels, op.name)(*args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_invalid_backend_is_rejected(op: Op, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVASIR_KERNELS='cuda' is not one of auto, triton, torch"):
        getattr(kernels, op.name)(*op.args(DEVICE))


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_triton_on_cpu_needs_the_interpreter(op: Op, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read when the backend is chosen; kernels stay interpreted
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        getattr(kernels, op.name)(*op.args(torch.device("cpu")))


def test_layers_go_through_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVASIR_KERNELS", "triton")
    calls = {
        name: spy(monkeypatch, f"kvasir.kernels.triton_ops.{module}", name)
        for name, module in [
            ("rms_norm", "norm"),
            ("fused_add_rms_norm", "norm"),
            ("apply_rotary", "rotary"),
            ("silu_and_mul", "activation"),
        ]
    }
    norm, mlp = RMSNorm(8, eps=1e-6).to(DEVICE), GatedMLP(8, 16).to(DEVICE)
    x = _x(3, 8)
    norm(x)
    norm(x, x)
    apply_rotary(_x(3, 2, 8), *_angles())
    mlp(x)
    assert {name: len(c) for name, c in calls.items()} == dict.fromkeys(calls, 1)


def test_the_choice_is_made_once_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """After start-up, a changed environment no longer switches the kernels under a running model."""
    monkeypatch.setenv("KVASIR_KERNELS", "torch")
    assert choose_backend(DEVICE) is False
    monkeypatch.setenv("KVASIR_KERNELS", "triton")
    assert use_triton(DEVICE) is False
    monkeypatch.setenv("KVASIR_KERNELS", "nonsense")
    assert use_triton(DEVICE) is False  # nothing is read on the hot path
    reset_backend_choice()
    with pytest.raises(ValueError, match="KVASIR_KERNELS='nonsense'"):
        use_triton(DEVICE)


def test_a_bad_setting_fails_when_the_engine_starts(monkeypatch: pytest.MonkeyPatch, tiny_checkpoint) -> None:
    from kvasir.runtime.config import EngineConfig
    from kvasir.runtime.engine.llm_engine import LLMEngine

    monkeypatch.setenv("KVASIR_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVASIR_KERNELS='cuda' is not one of"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu"))
