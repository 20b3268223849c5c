"""The batched sampler: one token (and optional logprobs) per row of the step's logits.

Order follows vLLM: logprobs come from the raw model distribution; then penalties, min_tokens
suppression, argmax for greedy rows; sampled rows are divided by their temperature, truncated by
top-k / top-p / min-p (one sort per step for the rows that need it) and drawn with the
"exponential race" argmax(p / E), E ~ Exp(1). The noise for (row, vocab id) is a pure function of
(seed, output position, vocab id), so a request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from kvasir.runtime.outputs import SamplerOutput
from kvasir.runtime.sample.metadata import SamplingBatch

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "apply_token_bitmask",
    "exponential_noise",
    "process_logits",
    "sampling_probs",
    "uniform_noise",
    "with_logprobs",
]


class Sampler:
    """Stateless: `sampler(logits, batch)` picks one token per row of `logits` [R, V]."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """One token per row (speculative decoding verifies drafts with the same steps instead:
        `kvasir.runtime.spec_decode.verification`)."""
        raw, processed = process_logits(logits, batch)
        if batch.all_greedy:
            tokens = processed.argmax(dim=-1)
        elif batch.all_random:
            tokens = _sample(processed, batch, rows=None)
        else:
            tokens = processed.argmax(dim=-1)
            rows = torch.nonzero(~batch.greedy_mask).squeeze(1)
            tokens[rows] = _sample(processed[rows], batch, rows)
        return with_logprobs(tokens, raw, batch)


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, processed): the model's float logits [R, V], and those after penalties and
    min_tokens suppression, which every choice of a token reads."""
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] != batch.vocab_size:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match the batch "
            f"({batch.num_rows} rows, vocab {batch.vocab_size})"
        )
    raw = logits.float()
    # Every step below is out of place: `raw` must stay the model's distribution for logprobs.
    processed = apply_penalties(raw, batch) if batch.needs_penalties else raw
    if batch.token_bitmask is not None:
        processed = apply_token_bitmask(processed, batch.token_bitmask)
    if batch.suppressed_token_ids is not None:
        suppressed = _mask_columns(processed, batch.suppressed_token_ids)
        if batch.token_bitmask is not None:
            # min_tokens holds EOS off, but a finished grammar allows nothing else: the grammar wins.
            empty = torch.isneginf(suppressed.amax(dim=-1, keepdim=True))
            suppressed = torch.where(empty, processed, suppressed)
        processed = suppressed
    return raw, processed


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [R, V] with -inf where the grammar mask disallows a token (structured output).

    The mask is packed bits, [R, ceil(V / 32)] int32 with a 0 bit for a disallowed token (only the
    rows that are not all ones are unpacked), or already additive, [R, V] float with 0 or -inf."""
    if bitmask.is_floating_point():
        return logits + bitmask
    vocab = logits.shape[1]
    constrained = torch.nonzero((bitmask != -1).any(dim=1)).squeeze(1)
    if constrained.numel() == 0:
        return logits
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    words = bitmask[constrained]
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab].bool()
    masked = logits.clone()
    masked[constrained] = logits[constrained].masked_fill(~allowed, float("-inf"))
    return masked


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF-style, prompt + output), then frequency and presence (OpenAI-style, output)."""
    num_rows, vocab = logits.shape
    assert batch.output_token_ids is not None  # build() always packs outputs when penalties are on
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(
        1, batch.output_token_ids, torch.ones_like(batch.output_token_ids, dtype=logits.dtype)
    )
    counts = counts[:, :vocab]  # drop the padding column
    generated = counts > 0
    if batch.prompt_token_ids is not None:
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, batch.prompt_token_ids, True)
        seen = seen[:, :vocab] | generated
        penalty = batch.repetition_penalty.unsqueeze(1)
        # Shrink towards zero either way: divide positive logits, multiply negative ones.
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    return logits - batch.presence_penalty.unsqueeze(1) * generated.to(logits.dtype)


def _mask_columns(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set logits[r, token_ids[r, j]] to -inf; ids equal to V are padding and land in a dropped column."""
    num_rows, vocab = logits.shape
    mask = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, token_ids, True)
    return logits.masked_fill(mask[:, :vocab], float("-inf"))


def _sample(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None) -> torch.Tensor:
    """Draw one token per row of `logits` (the batch rows `rows`, or all when None)."""
    probs = sampling_probs(logits, batch, rows)
    take_seeds = batch.seeds if rows is None else batch.seeds[rows]
    take_positions = batch.output_positions if rows is None else batch.output_positions[rows]
    noise = exponential_noise(take_seeds, take_positions, logits.shape[1])
    return (probs / noise).argmax(dim=-1)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None) -> torch.Tensor:
    """The sampling distribution of each row: temperature, then top-k / top-p / min-p."""

    def take(values: torch.Tensor) -> torch.Tensor:
        return values if rows is None else values[rows]

    logits = logits / take(batch.temperature).unsqueeze(1)
    if batch.needs_top_k or batch.needs_top_p:
        logits = _apply_top_k_top_p(logits, take(batch.top_k), take(batch.top_p))
    if batch.needs_min_p:
        logits = _apply_min_p(logits, take(batch.min_p))
    return torch.softmax(logits, dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top_k, then outside its top_p nucleus."""
    vocab = logits.shape[1]
    # Stable, so ties land in the same order whatever the other rows are.
    sorted_logits, order = logits.sort(dim=-1, stable=True)  # ascending
    # Ties with the k-th largest logit are kept (as in vLLM), so a row may keep a few more than k.
    kth_largest = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))
    drop = sorted_logits < kth_largest
    # Nucleus over the top-k renormalised distribution: drop the low tail whose mass is <= 1 - p,
    # i.e. keep the smallest high-probability set reaching p; the most likely token always stays.
    tail_mass = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
    drop_p = tail_mass <= (1.0 - top_p).unsqueeze(1)
    drop_p[:, -1] = False
    drop |= drop_p & (top_p < 1.0).unsqueeze(1)
    mask = torch.zeros_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability (in log space)."""
    # log(0) = -inf keeps every token of rows with min_p = 0.
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def with_logprobs(
    tokens: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch, accepted: list[bool] | None = None
) -> SamplerOutput:
    """The output for `tokens` [R], with each row's logprobs from `raw` when the batch asks."""
    token_ids = tokens.tolist()
    max_k = batch.max_num_logprobs
    if max_k is None:
        return SamplerOutput(token_ids, None, None, accepted, tokens)
    logprobs = torch.log_softmax(raw, dim=-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if max_k > 0:
        values, indices = logprobs.topk(max_k, dim=-1)
        value_rows, index_rows = values.tolist(), indices.tolist()
        for row, k in enumerate(batch.num_logprobs):
            if k:
                top[row] = list(zip(index_rows[row][:k], value_rows[row][:k], strict=True))
    return SamplerOutput(token_ids, sampled, top, accepted, tokens)


# splitmix64 constants, written as the int64 two's-complement values torch can hold.
def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64: torch's `>>` is arithmetic, so clear the sign-extended bits."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in place on a fresh int64 tensor; the multiplications wrap like uint64."""
    # In place because this runs over [R, V]: it halves the time against out-of-place ops.
    for shift, multiplier in ((30, _MIX1), (27, _MIX2)):
        z ^= _shift_right(z, shift)
        z *= multiplier
    z ^= _shift_right(z, 31)
    return z


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 in (0, 1), a pure function of (seeds[r], positions[r], v): a counter-based hash."""
    row_keys = _mix64_(_mix64_(seeds.to(torch.int64).clone()) + positions.to(torch.int64) * _GOLDEN)
    counters = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) * _GOLDEN
    bits = _mix64_(row_keys.unsqueeze(1) + counters.unsqueeze(0))
    # The top 23 bits plus a half: exact in float32 and never 0 or 1.
    return (_shift_right(bits, 41).to(torch.float32) + 0.5) * (2.0**-23)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] Exp(1) samples by inversion of `uniform_noise`."""
    return uniform_noise(seeds, positions, vocab_size).log_().neg_()
