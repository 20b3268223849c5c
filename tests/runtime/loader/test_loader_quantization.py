"""`--quantization` against what a checkpoint declares: detection, agreement, and clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.model_files import open_model
from kvasir.runtime.loader.quantization import Quantization, declared_hf_quantization, resolve_quantization


@pytest.mark.parametrize(
    ("quant_method", "method"),
    [("fp8", "fp8"), ("compressed-tensors", "fp8"), ("awq", "awq"), ("gptq", "gptq")],
)
def test_hf_quant_methods_map_to_vllm_names(quant_method: str, method: str) -> None:
    assert declared_hf_quantization({"quantization_config": {"quant_method": quant_method}}, "c") == method


def test_unknown_or_malformed_quantization_config_is_named() -> None:
    assert declared_hf_quantization({}, "config.json") is None
    with pytest.raises(ModelLoadError, match=r"config.json: quantization_config.quant_method 'bnb'"):
        declared_hf_quantization({"quantization_config": {"quant_method": "bnb"}}, "config.json")
    with pytest.raises(ModelLoadError, match="'quantization_config' must be an object"):
        declared_hf_quantization({"quantization_config": "awq"}, "config.json")


def test_the_flag_must_agree_with_the_checkpoint() -> None:
    assert resolve_quantization(None, "gguf", "m.gguf") == Quantization("gguf")
    assert resolve_quantization("awq", "awq", "m") == Quantization("awq")
    assert resolve_quantization(None, None, "m") == Quantization(None)
    assert resolve_quantization("fp8", None, "m") == Quantization("fp8", at_load=True)
    with pytest.raises(ModelLoadError, match=r"--quantization awq: m\.gguf is stored as gguf"):
        resolve_quantization("awq", "gguf", "m.gguf")
    with pytest.raises(ModelLoadError, match="--quantization gptq: m holds float weights; only fp8 can"):
        resolve_quantization("gptq", None, "m")


def test_a_gguf_file_loads_as_gguf_and_refuses_another_method(tiny_gguf: Path) -> None:
    files = open_model(str(tiny_gguf))
    assert files.quantization == Quantization("gguf") and files.config.quantization == "gguf"
    with pytest.raises(ModelLoadError, match=r"--quantization fp8: .* is stored as gguf"):
        open_model(str(tiny_gguf), quantization="fp8")


def test_a_float_folder_is_unquantized(tiny_checkpoint: object) -> None:
    path = tiny_checkpoint("llama")  # type: ignore[operator]
    files = open_model(str(path))
    assert files.quantization == Quantization(None) and files.config.quantization is None


@pytest.fixture
def tiny_gguf() -> Path:
    from kvasir.runtime.loader.embedded import embedded_model_path

    return embedded_model_path()
