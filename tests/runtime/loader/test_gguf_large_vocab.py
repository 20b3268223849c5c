"""A 151,936-token vocabulary (Qwen2/2.5/3's) in the types files keep their embedding and LM head in
(Q6_K, Q8_0, F16): the table stays packed (or 16-bit), the embedding and a tied head share one
copy, and a lookup and the head's product agree with gguf-py's dequantization of the same blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvasir.runtime.layers.quantization.gguf import GGUFWeight
from kvasir.runtime.layers.quantization.gguf_blocks import BLOCK_TYPES, F16_FIELDS
from kvasir.runtime.layers.quantization.half import HalfWeight

VOCAB = 151936
CPU = torch.device("cpu")


def _random_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    """Random bytes in every field, small finite float16 scales."""
    per_block, block_bytes, _, _ = BLOCK_TYPES[type_name]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
    for start in F16_FIELDS[type_name]:
        scales = (rng.standard_normal((len(blocks), 1)) * 1e-3).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize(("type_name", "hidden"), [("Q8_0", 64), ("Q6_K", 256)])
def test_a_packed_vocabulary_table_is_shared_and_exact(type_name: str, hidden: int) -> None:
    raw = _random_blocks(type_name, VOCAB, hidden)
    weight = GGUFWeight(type_name, raw, (VOCAB, hidden))
    embedding = weight.build_embedding(CPU, torch.float32)
    head = GGUFWeight.build_linear([weight], CPU, torch.float32)  # tied: the same weight
    assert head.codes.data_ptr() == embedding.codes.data_ptr()  # type: ignore[attr-defined]
    ids = torch.tensor([VOCAB - 1, 0, 77_777, 151_935 - 16])
    expected = torch.from_numpy(dequantize(raw[ids.numpy()], GGMLQuantizationType[type_name]))
    assert torch.equal(embedding(ids), expected.reshape(len(ids), hidden))
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(3))
    rows = torch.arange(0, VOCAB, 997)  # a sample of the head's rows, all tiles' positions
    reference = x @ torch.from_numpy(dequantize(raw[rows.numpy()], GGMLQuantizationType[type_name])).T
    scale = reference.abs().max().item()
    # The default CPU arithmetic rounds x to 16 bits per block of 32 (docs/quantization.md).
    torch.testing.assert_close(head(x)[:, rows], reference, rtol=0, atol=2e-4 * scale)
    bytes_held = sum(t.numel() * t.element_size() for t in head.buffers())
    assert bytes_held < VOCAB * hidden * 2  # packed: under 16 bits a weight, not float32's 32


def test_an_f16_vocabulary_table_stays_16_bit_and_shared() -> None:
    table = torch.randn(VOCAB, 64, generator=torch.Generator().manual_seed(1)).half()
    weight = HalfWeight(table)
    embedding = weight.build_embedding(CPU, torch.float32)
    head = HalfWeight.build_linear([weight], CPU, torch.float32)
    assert head.weight.data_ptr() == embedding.weight.data_ptr() == table.data_ptr()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(head(x), x @ table.float().T, rtol=1e-5, atol=1e-4)
    assert torch.equal(embedding(torch.tensor([VOCAB - 1])), table[-1:].float())
