"""Shared fixtures: tiny Hugging Face checkpoints, written once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_checkpoints import make_tiny_checkpoint

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. Triton reads this
# when a kernel is defined, so it is set here, before any test imports kvasir.kernels.triton_ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _fresh_kernel_backend_choice() -> Any:
    """The kernel backend is chosen once and kept; each test reads its own KVASIR_KERNELS afresh."""
    from kvasir.kernels.dispatch import reset_backend_choice

    reset_backend_choice()
    yield
    reset_backend_choice()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(family, **overrides)` -> a checkpoint folder, shared by every test asking the same.

    Tests must treat the folder as read-only.
    """
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, **overrides: Any) -> Path:
        key = (family, repr(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(family), family, **overrides)
        return made[key]

    return get
