"""A rank's slice of a GGUF tensor, cut from the memory-mapped file before anything is decoded.

GGUF stores a matrix row by row, each row a run of quantization blocks (32 or 256 values each,
`GGML_QUANT_SIZES`). So a rank's rows (column-parallel q/k/v, gate/up, the vocabulary range of the
embedding and LM head) are whole rows of blocks: kept packed, exactly as stored. A rank's columns
(row-parallel o_proj and down_proj) are whole blocks of every row when the split falls on a block
boundary, and are then kept packed too. Where it does not (an input width whose 1/N is not a
multiple of the block: e.g. Q4_K's 256 values with intermediate_size/N = 1408 + 128), the rank
reads the blocks that cover its columns, dequantizes them to float32 and keeps its columns: that
layer runs dense on this rank. The loader logs one line naming how many tensors took that path.

Only the selected bytes are copied out of the map: the other ranks' rows and blocks are never read.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvasir.runtime.parallel.partition import TensorShard


def rows_view(data: np.ndarray, rows: int) -> np.ndarray:
    """A 2-D tensor's data as [rows, stored units per row] (bytes of a quantized type, values of a
    float one); a view of the map, nothing read."""
    return np.asarray(data).reshape(rows, -1)


def select(
    view: np.ndarray, tensor_type: GGMLQuantizationType, shard: TensorShard
) -> tuple[np.ndarray, slice | None]:
    """The stored units of `view` ([rows, units]) that hold the shard, and None when they hold it
    exactly, else the columns to keep of their dequantized values (a split inside a block)."""
    if shard.dim == 0:
        return view[shard.start : shard.stop], None
    # Types stored one number per element (F32, F16) come as typed arrays: a unit is a value.
    per_block, block_bytes = GGML_QUANT_SIZES[tensor_type] if view.dtype == np.uint8 else (1, 1)
    first, last = shard.start // per_block, -(-shard.stop // per_block)
    covering = view[:, first * block_bytes : last * block_bytes]
    if shard.start % per_block == 0 and shard.stop % per_block == 0:
        return covering, None
    offset = first * per_block
    return covering, slice(shard.start - offset, shard.stop - offset)


def aligned(tensor_type: GGMLQuantizationType, shard: TensorShard) -> bool:
    """Whether the shard keeps whole blocks (always for rows; for columns, on block boundaries)."""
    per_block = GGML_QUANT_SIZES[tensor_type][0]
    return shard.dim == 0 or (shard.start % per_block == 0 and shard.stop % per_block == 0)
