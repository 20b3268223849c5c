"""GGUFFile against the `gguf` package's own GGUFReader: the same metadata values and the same
tensor views (dtype, shape, bytes), on the embedded model and on a file holding every value type;
bad files refused with a reason; `release` leaves the data readable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, ReaderField

from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.loader.gguf_file import GGUFFile
from tests.gguf_encode import encode

Q = GGMLQuantizationType


def reference_value(field: ReaderField) -> Any:
    """A metadata value as plain Python, read through GGUFReader's per-item views."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            return None  # nested arrays
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    part = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return bool(part[0]) if kind == GGUFValueType.BOOL else part[0].item()


def assert_same_as_reader(path: Path) -> None:
    ours, reference = GGUFFile(path), GGUFReader(path)
    # GGUFReader also lists the header's counts as pseudo-fields ("GGUF.version", ...).
    fields = {name: field for name, field in reference.fields.items() if not name.startswith("GGUF.")}
    assert ours.metadata == {name: reference_value(field) for name, field in fields.items()}
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(theirs.data).view(np.uint8))


def test_embedded_model_reads_as_gguf_reader_reads_it() -> None:
    assert_same_as_reader(embedded_model_path())


def write_every_kind(path: Path) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.true", True)
    writer.add_bool("t.false", False)
    writer.add_string("t.text", "héllo ▁wörld")
    writer.add_array("t.strings", ["a", "", "ß", "<|im_end|>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((64,)).astype(np.float16))
    for qtype in (Q.Q4_1, Q.Q8_0, Q.Q6_K):
        writer.add_tensor(qtype.name, encode(rng.standard_normal((4, 256)), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_kind_reads_as_gguf_reader_reads_it(tmp_path: Path) -> None:
    path = write_every_kind(tmp_path / "kinds.gguf")
    assert_same_as_reader(path)
    metadata = GGUFFile(path).metadata
    assert metadata["t.u64"] == 2**63 + 5 and metadata["t.true"] is True
    assert metadata["t.strings"] == ["a", "", "ß", "<|im_end|>"] and metadata["t.nested"] is None


def test_release_keeps_the_data_readable(tmp_path: Path) -> None:
    path = write_every_kind(tmp_path / "kinds.gguf")
    file = GGUFFile(path)
    before = [tensor.data.copy() for tensor in file.tensors]
    for tensor in file.tensors:
        file.release(tensor)
    assert all(np.array_equal(t.data, b) for t, b in zip(file.tensors, before, strict=True))


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda data: b"GGML" + data[4:], "no GGUF magic"),
        (lambda data: data[:4] + (7).to_bytes(4, "little") + data[8:], "version 7 is not supported"),
        (lambda data: data[:4] + (3).to_bytes(4, "big") + data[8:], "big-endian"),
        (lambda data: data[:200], "past the end of the file"),
        (lambda data: data[:-100], "runs past the end of the file"),
        (lambda data: data[:10], "too short"),
    ],
)
def test_bad_files_are_refused_with_the_reason(tmp_path: Path, edit: Any, reason: str) -> None:
    good = write_every_kind(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(edit(good))
    with pytest.raises(ValueError, match=reason):
        GGUFFile(bad)
