"""Projections of the same input that a checkpoint stores separately, run as one GEMM.

`q_proj`, `k_proj` and `v_proj` (or `gate_proj` and `up_proj`) read the same activations: one
matrix multiply over their stacked weights reads the input once and launches one kernel instead of
three (on a GPU the decode step is a few hundred launches; this removes two per layer).
Checkpoints keep their own names: `checkpoint_views` maps each of them to its rows of the stacked
parameter, and `CausalLM.load_weights` copies into those views.
"""

from __future__ import annotations

from torch import Tensor, nn


class MergedLinear(nn.Linear):
    """One linear layer standing for the checkpoint projections `parts` (name -> output size)."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.part_names = tuple(parts)
        self.output_sizes = tuple(parts.values())

    def forward_parts(self, x: Tensor) -> tuple[Tensor, ...]:
        """Each part's output [T, size]: views into one [T, total] result (rows strided, not copied)."""
        return self(x).split(self.output_sizes, dim=-1)

    def checkpoint_views(self) -> dict[str, Tensor]:
        """`{part}.weight` (and `{part}.bias`) -> the rows of the stacked parameter that part fills."""
        views: dict[str, Tensor] = {}
        offset = 0
        for name, size in zip(self.part_names, self.output_sizes, strict=True):
            views[f"{name}.weight"] = self.weight.narrow(0, offset, size)
            if self.bias is not None:
                views[f"{name}.bias"] = self.bias.narrow(0, offset, size)
            offset += size
        return views

    def extra_repr(self) -> str:
        parts = ", ".join(
            f"{name}={size}" for name, size in zip(self.part_names, self.output_sizes, strict=True)
        )
        return f"in_features={self.in_features}, {parts}, bias={self.bias is not None}"
