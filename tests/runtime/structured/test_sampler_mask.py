"""The sampler's side of constrained decoding: `apply_token_bitmask` against a bit-by-bit
reference (vocabularies that are not a multiple of 32, the sign bit, rows left all ones), and a
mask that allows only EOS while min_tokens holds EOS off: the grammar wins, no NaN, EOS sampled."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from kvasir.runtime.core.request import Request
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.sample.sampler import Sampler, SamplingBatch, apply_token_bitmask, process_logits
from kvasir.runtime.structured.matcher import bitmask_words
from kvasir.runtime.worker.grammar_masks import additive_mask

CPU = torch.device("cpu")


def pack(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """Bit t of row r set when t is in allowed[r] (a reference packing, numpy's)."""
    words = bitmask_words(vocab)
    rows = np.zeros((len(allowed), words * 32), dtype=np.uint8)
    for r, tokens in enumerate(allowed):
        rows[r, sorted(tokens)] = 1
    return torch.from_numpy(np.packbits(rows, axis=1, bitorder="little").view(np.int32).copy())


@pytest.mark.parametrize("vocab", [31, 32, 33, 384, 1000])
def test_apply_token_bitmask_masks_exactly_the_zero_bits(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    allowed = [set(rng.choice(vocab, size=k, replace=False).tolist()) for k in (1, vocab // 3, vocab)]
    allowed.append({vocab - 1, 0} | ({31} if vocab > 31 else set()))  # the sign bit of word 0
    logits = torch.randn(len(allowed), vocab, generator=torch.Generator().manual_seed(vocab))
    bitmask = pack(allowed, vocab)
    masked = apply_token_bitmask(logits, bitmask)
    for row, tokens in enumerate(allowed):
        finite = set(torch.nonzero(torch.isfinite(masked[row])).squeeze(1).tolist())
        assert finite == tokens
        keep = sorted(tokens)
        assert torch.equal(masked[row, keep], logits[row, keep])
    assert not torch.isinf(logits).any(), "the input was modified"


def _request(params: SamplingParams, eos: int) -> Request:
    return Request("r", [5, 6, 7], params, max_tokens=params.max_tokens or 16, seed=3, eos_token_ids=(eos,))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_mask_allowing_only_eos_beats_min_tokens(temperature: float) -> None:
    vocab, eos = 64, 2
    params = SamplingParams(temperature=temperature, seed=1, min_tokens=10, max_tokens=16, logprobs=2)
    free = SamplingParams(temperature=temperature, seed=2, min_tokens=10, max_tokens=16)
    requests = [_request(params, eos), _request(params, eos), _request(free, eos)]
    batch = SamplingBatch.build(requests, vocab, CPU)
    assert batch.suppressed_token_ids is not None
    # Row 0: the grammar allows only EOS (complete); row 1: EOS or token 9; row 2: no grammar.
    bitmask = pack([{eos}, {eos, 9}, set(range(vocab))], vocab)
    batch = dataclasses.replace(batch, token_bitmask=bitmask)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    _, processed = process_logits(logits, batch)
    assert not torch.isnan(processed).any()
    assert torch.isfinite(processed[0, eos]) and torch.isinf(processed[0]).sum() == vocab - 1
    assert torch.isinf(processed[1, eos]) and torch.isfinite(processed[1, 9])  # min_tokens holds EOS off
    assert torch.isinf(processed[2, eos]) and torch.isfinite(processed[2]).sum() == vocab - 1
    output = Sampler()(logits, batch)
    assert output.token_ids[:2] == [eos, 9] and output.token_ids[2] != eos
    assert output.logprobs is not None
    assert all(math.isfinite(logprob) for logprob in output.logprobs)


def test_the_additive_cpu_mask_equals_the_packed_bits() -> None:
    """A CPU step's mask is unpacked on the helper thread into 0 / -inf (added to the logits): the
    same logits as unpacking the bits in the sampler, for every bit position and a ragged vocab."""
    generator = torch.Generator().manual_seed(3)
    vocab = 1000  # not a multiple of 32
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    bitmask[2] = -1  # a row without a grammar
    bitmask[4] = 0  # a row allowing nothing
    logits = torch.randn(6, vocab, generator=generator)
    packed = apply_token_bitmask(logits, bitmask)
    additive = apply_token_bitmask(logits, torch.from_numpy(additive_mask(bitmask.numpy(), vocab)))
    assert torch.equal(packed, additive)
    assert torch.isinf(additive[4]).all() and torch.equal(additive[2], logits[2])
    assert np.isneginf(additive_mask(bitmask.numpy(), vocab)[4]).all()
