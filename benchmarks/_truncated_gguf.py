"""A smaller draft model for `draft_model` speculation when no hub is reachable: a GGUF model's
first L layers (plus its embeddings, final norm and LM head) written out as a GGUF file of its own.

It shares the target's tokenizer, as a draft model must. It is not a trained draft (those are
distilled, and usually better for the same size), so its acceptance is a lower bound of what a
real pair such as a 135M draft for a 1.7B target gets.
"""

from __future__ import annotations

from pathlib import Path

import gguf


def write_truncated_gguf(source: Path, target: Path, num_layers: int) -> Path:
    """Copy `source` to `target` keeping only blocks 0..num_layers-1; returns `target`."""
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    block_count_key = f"{arch}.block_count"
    total = int(reader.fields[block_count_key].contents())
    if not 0 < num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total}), got {num_layers}")
    writer = gguf.GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        value = num_layers if key == block_count_key else field.contents()
        sub_type = field.types[1] if field.types[0] is gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
