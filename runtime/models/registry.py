"""Which model class serves which Hugging Face `architectures` entry."""

from __future__ import annotations

from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.models.base import CausalLM
from kvasir.runtime.models.llama import LlamaForCausalLM
from kvasir.runtime.models.mistral import MistralForCausalLM
from kvasir.runtime.models.qwen2 import Qwen2ForCausalLM
from kvasir.runtime.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class for `architecture` (e.g. "LlamaForCausalLM"); ModelLoadError naming the supported ones."""
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(_MODELS)}"
        ) from None
