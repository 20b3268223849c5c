"""Our model files over the paged KV cache against Hugging Face transformers, on tiny checkpoints.

Every family, and the features that set families apart (rope scaling, tied embeddings, biases,
q/k norm, sliding windows), must give the same logits as `transformers` (eager attention, float32),
whether a prompt is computed at once, in chunks, or token by token in mixed batches.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from kvasir.runtime.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvasir.runtime.layers.rotary import RotaryEmbedding
from kvasir.runtime.loader.errors import ModelLoadError
from kvasir.runtime.loader.hf_config import model_config_from_hf
from kvasir.runtime.models.base import CausalLM
from kvasir.runtime.models.registry import get_model_class
from tests.runtime.models.paged_runner import PagedRunner
from tests.tiny_checkpoints import SPECIAL_TOKENS

ATOL = 1e-4
PROMPT_LENGTHS = (5, 13, 16, 29)

# (family, config overrides): every family, plus the variants a family's default does not cover.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-gqa-llama3-rope": ("llama-gqa-llama3-rope", {}),
    "llama-linear-rope": ("llama-linear-rope", {}),
    "mistral-window-8": ("mistral", {}),
    "qwen2-tied": ("qwen2", {}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    # Layer 0 full attention, layer 1 a 6-token window (Qwen's max_window_layers).
    "qwen2-sliding-layers": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),
}


@dataclasses.dataclass
class Case:
    path: Path
    config: ModelConfig
    ours: CausalLM
    hf: Any  # a transformers PreTrainedModel
    prompts: list[list[int]]
    expected: list[torch.Tensor]  # HF logits per prompt, [len, vocab]


def build_model(path: Path, config: ModelConfig | None = None) -> CausalLM:
    config = config or model_config_from_hf(json.loads((path / "config.json").read_text()))
    model = get_model_class(config.architecture)(config)
    model.load_weights(load_file(path / "model.safetensors").items())
    return model


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> Case:
    family, overrides = CASES[request.param]
    path = tiny_checkpoint(family, **overrides)
    ours = build_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    g = torch.Generator().manual_seed(7)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(len(SPECIAL_TOKENS), vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    with torch.no_grad():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
    return Case(path, ours.config, ours, hf, prompts, expected)


def test_full_prompts_in_one_batch(case: Case) -> None:
    runner = PagedRunner(case.ours)
    logits = runner.step([(r, p, 0) for r, p in enumerate(case.prompts)])
    for ours, expected in zip(logits, case.expected, strict=True):
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
        assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_chunks_of_three_then_decodes(case: Case) -> None:
    """Prompt chunks of 3 up to half the prompt, then one token per step, all requests batched."""
    runner = PagedRunner(case.ours, seed=1)
    done = [0] * len(case.prompts)
    got: list[list[torch.Tensor]] = [[] for _ in case.prompts]
    mixed_steps = 0
    while any(d < len(p) for d, p in zip(done, case.prompts, strict=True)):
        chunks = []
        for r, prompt in enumerate(case.prompts):
            if done[r] < len(prompt):
                size = min(3, len(prompt) // 2 - done[r]) if done[r] < len(prompt) // 2 else 1
                chunks.append((r, prompt[done[r] : done[r] + size], done[r]))
        sizes = {len(tokens) for _, tokens, _ in chunks}
        mixed_steps += 1 in sizes and len(sizes) > 1
        for (r, tokens, _), logits in zip(chunks, runner.step(chunks), strict=True):
            got[r].append(logits)
            done[r] += len(tokens)
    assert mixed_steps > 0  # some steps batched decodes with prompt chunks
    for ours, expected in zip(got, case.expected, strict=True):
        torch.testing.assert_close(torch.cat(ours), expected, atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers(case: Case) -> None:
    new_tokens = 10
    prompts = case.prompts[1:3]
    runner = PagedRunner(case.ours, seed=2)
    outputs: list[list[int]] = [[] for _ in prompts]
    logits = runner.step([(r, p, 0) for r, p in enumerate(prompts)])
    for _ in range(new_tokens):
        chunks = []
        for r, (prompt, rows) in enumerate(zip(prompts, logits, strict=True)):
            outputs[r].append(int(rows[-1].argmax()))
            chunks.append((r, outputs[r][-1:], len(prompt) + len(outputs[r]) - 1))
        logits = runner.step(chunks)
    for prompt, ours in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        reference = case.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        assert ours == reference[0, len(prompt) :].tolist()


# Remove the feature and parity must break: proof that the tiny checkpoints exercise it.
FEATURES = {
    "llama3-rope": ("llama-gqa-llama3-rope", {}, {"rope_scaling": None}),
    "linear-rope": ("llama-linear-rope", {}, {"rope_scaling": None}),
    "mistral-window": ("mistral", {}, {"sliding_window": None}),
    "qwen2-sliding-layers": CASES["qwen2-sliding-layers"] + ({"sliding_window": None},),
}


@pytest.mark.parametrize("feature", list(FEATURES.values()), ids=list(FEATURES))
def test_features_are_exercised(feature: tuple, tiny_checkpoint: Callable[..., Path]) -> None:
    family, overrides, removed = feature
    path = tiny_checkpoint(family, **overrides)
    config = model_config_from_hf(json.loads((path / "config.json").read_text()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    prompt = list(range(10, 40))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    for model_config, should_match in ((config, True), (dataclasses.replace(config, **removed), False)):
        (logits,) = PagedRunner(build_model(path, model_config)).step([(0, prompt, 0)])
        assert torch.allclose(logits, expected, atol=ATOL, rtol=0) == should_match


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        # Llama 3.1's published values, at a realistic head_dim and theta.
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=["default", "linear", "llama3"],
)
def test_rotary_table_is_bit_identical_to_transformers(scaling: dict[str, Any] | None) -> None:
    rope = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    hf_config = transformers.LlamaConfig(
        hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072, rope_parameters=rope
    )
    hf_rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    positions = torch.tensor([0, 1, 7, 100, 4095, 8191, 8192, 50000, 131071])
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(128, 131072, 500000.0, scaling)
    cos, sin = ours(positions)
    assert torch.equal(torch.cat((cos, cos), -1)[:, 0], hf_cos[0])
    assert torch.equal(torch.cat((sin, sin), -1)[:, 0], hf_sin[0])


def test_sharded_checkpoint_loads_the_same_weights(tiny_checkpoint: Callable[..., Path]) -> None:
    single = build_model(tiny_checkpoint("llama"))
    sharded_path = tiny_checkpoint("llama", sharded=True)
    shards = sorted(sharded_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    sharded = get_model_class("LlamaForCausalLM")(single.config)
    sharded.load_weights(item for shard in shards for item in load_file(shard).items())
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def llama_weights(tiny_checkpoint: Callable[..., Path]) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tiny_checkpoint("llama")
    return path, load_file(path / "model.safetensors")


def _load(path: Path, weights: dict[str, torch.Tensor], **config_changes: Any) -> CausalLM:
    config = model_config_from_hf(json.loads((path / "config.json").read_text()))
    model = get_model_class(config.architecture)(dataclasses.replace(config, **config_changes))
    model.load_weights(weights.items())
    return model


def test_missing_tensor_is_named(llama_weights: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, weights = llama_weights
    weights = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ModelLoadError, match=r"missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(path, weights)


def test_wrong_shape_names_expected_and_got(llama_weights: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, weights = llama_weights
    weights = {**weights, "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}
    with pytest.raises(
        ModelLoadError,
        match=r"model\.layers\.0\.self_attn\.k_proj\.weight \(expected \(64, 64\), got \(32, 64\)\)",
    ):
        _load(path, weights)


def test_unexpected_tensor_is_named(llama_weights: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, weights = llama_weights
    weights = {**weights, "model.layers.7.mlp.up_proj.weight": torch.zeros(128, 64)}
    with pytest.raises(ModelLoadError, match=r"unexpected: model\.layers\.7\.mlp\.up_proj\.weight"):
        _load(path, weights)


def test_redundant_and_derived_tensors_are_ignored(
    llama_weights: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """A tied model ignores a redundant lm_head.weight and rotary inv_freq buffers, and converts dtype."""
    path, weights = llama_weights
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    model = _load(path, {**weights, **extra}, tie_word_embeddings=True)
    assert model.compute_logits(torch.zeros(1, 64)).shape == (1, 384)
    assert torch.equal(model.get_parameter("lm_head.weight"), weights["model.embed_tokens.weight"])
    halves = {k: v.half() for k, v in weights.items()}
    assert _load(path, halves).get_parameter("model.norm.weight").dtype == torch.float32


def test_every_supported_architecture_has_a_class() -> None:
    for architecture in SUPPORTED_ARCHITECTURES:
        assert issubclass(get_model_class(architecture), CausalLM)
    with pytest.raises(ModelLoadError, match="supported: LlamaForCausalLM, MistralForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_checkpoint_tensors_are_the_checkpoints_names_and_shapes(
    llama_weights: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Merged projections keep the checkpoint's names (what random-weight sources are built from)."""
    path, weights = llama_weights
    model = _load(path, weights)
    expected = {name: tuple(t.shape) for name, t in weights.items()}
    assert {name: tuple(t.shape) for name, t in model.checkpoint_tensors().items()} == expected
    layer = "model.layers.0.self_attn"
    # The q rows are a view of the merged parameter, not a copy.
    q_rows = model.checkpoint_tensors()[f"{layer}.q_proj.weight"]
    assert q_rows.data_ptr() == model.get_parameter(f"{layer}.qkv_proj.weight").data_ptr()
    torch.testing.assert_close(q_rows, weights[f"{layer}.q_proj.weight"], atol=0, rtol=0)
