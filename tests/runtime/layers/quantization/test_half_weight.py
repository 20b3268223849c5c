"""F16/BF16 matrices kept in 16 bits: each call widens them exactly, in chunks of rows on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kvasir.runtime.layers.quantization.half import HalfLinear, HalfWeight


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
def test_chunked_product_equals_the_widened_weights_gemm(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 96, generator=g).to(dtype)
    x = torch.randn(rows, 96, generator=g)
    kernel = HalfWeight(weight).build_linear([HalfWeight(weight)], torch.device("cpu"), torch.float32)
    assert isinstance(kernel, HalfLinear) and kernel.weight.dtype == dtype  # stays 16-bit
    kernel.chunk_rows = 64  # five chunks, the last one short
    expected = F.linear(x, weight.float())
    # Equal up to the order of float32 sums (values up to ~30 here: a few ulps).
    torch.testing.assert_close(kernel(x), expected, rtol=1e-5, atol=2e-5)
    assert kernel(x.view(rows, 1, 96)).shape == (rows, 1, 300)


def test_parts_stack_and_a_lookup_widens_only_its_rows() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(n, 32, generator=g).half() for n in (8, 4))
    kernel = HalfWeight(a).build_linear([HalfWeight(a), HalfWeight(b)], torch.device("cpu"), torch.float32)
    assert torch.equal(kernel.weight, torch.cat([a, b]))
    table = HalfWeight(a).build_embedding(torch.device("cpu"), torch.float32)
    ids = torch.tensor([3, 0, 3])
    assert torch.equal(table(ids), a.float()[ids])
    assert (
        HalfWeight(a).nbytes == 8 * 32 * 2 and HalfWeight(a).merge_key != HalfWeight(a.bfloat16()).merge_key
    )


def test_same_dtype_activations_use_the_weight_as_is() -> None:
    weight = torch.randn(16, 32).bfloat16()
    x = torch.randn(2, 32).bfloat16()
    kernel = HalfLinear(weight)
    assert torch.equal(kernel(x), F.linear(x, weight))


def test_only_16_bit_matrices_are_taken() -> None:
    with pytest.raises(ValueError, match="2-D float16 or bfloat16"):
        HalfWeight(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2-D float16 or bfloat16"):
        HalfWeight(torch.zeros(4).half())
