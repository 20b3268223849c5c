"""The batched sampler: greedy, truncation statistics, seeded reproducibility, penalties, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from kvasir.runtime.core.request import Request
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.sample.sampler import Sampler, SamplingBatch, apply_penalties, uniform_noise

CPU = torch.device("cpu")
EOS = 7
# Distinct probabilities, so top-k / top-p sets are unambiguous.
BASE_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.3, -0.5, -1.0, -3.0, 0.1])


def make_request(
    params: SamplingParams,
    *,
    seed: int = 0,
    prompt: Sequence[int] = (1, 2, 3),
    output: Sequence[int] = (),
    eos: tuple[int, ...] = (EOS,),
) -> Request:
    request = Request("r", list(prompt), params, max_tokens=64, seed=seed, eos_token_ids=eos)
    for token in output:
        request.append_output_token(token, 0.0)
    return request


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    batch = SamplingBatch.build(requests, logits.shape[1], CPU)
    return Sampler()(logits, batch).token_ids


def draw_many(
    params: SamplingParams, num_draws: int = 20_000, logits: torch.Tensor = BASE_LOGITS
) -> torch.Tensor:
    """Token frequencies of `num_draws` independent draws (one row per seed) from one distribution."""
    requests = [make_request(params, seed=seed) for seed in range(num_draws)]
    tokens = sample(logits.expand(num_draws, -1).clone(), requests)
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double() / num_draws


def assert_matches(freq: torch.Tensor, expected: torch.Tensor, num_draws: int = 20_000) -> None:
    """Tokens outside the support never appear; a chi-square test (p = 0.001) on the rest."""
    expected = expected.double() / expected.sum()
    outside = expected == 0
    assert freq[outside].sum().item() == 0.0, f"sampled a truncated token: {freq}"
    observed, wanted = freq[~outside] * num_draws, expected[~outside] * num_draws
    statistic = ((observed - wanted) ** 2 / wanted).sum().item()
    dof = int((~outside).sum().item()) - 1
    if dof == 0:
        return
    # Wilson-Hilferty approximation of the chi-square quantile at z = 3.09 (p = 0.001).
    critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert statistic < critical, f"chi2={statistic:.1f} >= {critical:.1f}: {freq} vs {expected}"


def test_greedy_is_argmax_of_each_row() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    requests = [make_request(SamplingParams(temperature=0.0), seed=i) for i in range(6)]
    assert sample(logits, requests) == logits.argmax(dim=-1).tolist()


def test_tiny_temperature_is_greedy_instead_of_overflowing() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 50
    requests = [make_request(SamplingParams(temperature=1e-7), seed=i) for i in range(3)]
    assert sample(logits, requests) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_scales_the_distribution(temperature: float) -> None:
    freq = draw_many(SamplingParams(temperature=temperature))
    assert_matches(freq, torch.softmax(BASE_LOGITS.double() / temperature, dim=-1))


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_top_k_keeps_the_k_most_likely_renormalised(top_k: int) -> None:
    probs = torch.softmax(BASE_LOGITS.double(), dim=-1)
    expected = torch.zeros_like(probs)
    keep = probs.topk(top_k).indices
    expected[keep] = probs[keep]
    assert_matches(draw_many(SamplingParams(top_k=top_k)), expected)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference top-p: the smallest most-likely set whose mass reaches top_p, renormalised."""
    expected = torch.zeros_like(probs)
    mass = 0.0
    for index in probs.argsort(descending=True).tolist():
        expected[index] = probs[index]
        mass += probs[index].item()
        if mass >= top_p:
            break
    return expected


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p_keeps_the_nucleus_renormalised(top_p: float) -> None:
    probs = torch.softmax(BASE_LOGITS.double(), dim=-1)
    assert_matches(draw_many(SamplingParams(top_p=top_p)), nucleus(probs, top_p))


@pytest.mark.parametrize("min_p", [0.1, 0.3])
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p: float) -> None:
    probs = torch.softmax(BASE_LOGITS.double(), dim=-1)
    expected = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    assert_matches(draw_many(SamplingParams(min_p=min_p)), expected)


def test_truncations_compose_after_temperature() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.05)
    probs = torch.softmax(BASE_LOGITS.double() / 0.7, dim=-1)
    top = torch.zeros_like(probs)
    keep = probs.topk(5).indices
    top[keep] = probs[keep]
    expected = nucleus(top / top.sum(), 0.8)
    expected = torch.where(expected >= 0.05 * expected.max(), expected, torch.zeros_like(expected))
    assert_matches(draw_many(params), expected)


def generate(params: SamplingParams, seed: int, steps: int, companions: int) -> list[int]:
    """Tokens of one request over `steps` steps, sampled in a batch with `companions` other rows."""
    gen = torch.Generator().manual_seed(1234)
    request = make_request(params, seed=seed)
    others = [
        make_request(SamplingParams(temperature=t, top_k=k, top_p=p), seed=100 + i)
        for i, (t, k, p) in enumerate([(0.0, 0, 1.0), (1.3, 4, 1.0), (0.8, 0, 0.5), (1.0, 0, 1.0)] * 3)
    ][:companions]
    tokens = []
    for _ in range(steps):
        row_logits = torch.randn(1, 64, generator=gen)
        batch = [*others[: companions // 2], request, *others[companions // 2 :]]
        logits = torch.randn(len(batch), 64, generator=torch.Generator().manual_seed(len(tokens)))
        logits[companions // 2] = row_logits[0]
        token = sample(logits, batch)[companions // 2]
        request.append_output_token(token, 0.0)
        tokens.append(token)
    return tokens


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)]
)
def test_seeded_tokens_do_not_depend_on_the_batch(params: SamplingParams) -> None:
    alone = generate(params, seed=42, steps=20, companions=0)
    assert generate(params, seed=42, steps=20, companions=0) == alone
    assert generate(params, seed=42, steps=20, companions=5) == alone
    assert generate(params, seed=42, steps=20, companions=12) == alone
    assert generate(params, seed=43, steps=20, companions=0) != alone


def test_noise_is_the_documented_splitmix64_hash() -> None:
    """Pin the hash: changing it would silently change every seeded generation."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds, positions, vocab = [0, -5, 2**63 - 1], [0, 3, 1000], 300
    noise = uniform_noise(torch.tensor(seeds), torch.tensor(positions), vocab)
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        key = mix(mix(seed) + position * 0x9E3779B97F4A7C15)
        for v in (0, 1, 299):
            bits = mix(key + v * 0x9E3779B97F4A7C15)
            assert noise[row, v].item() == ((bits >> 41) + 0.5) * 2.0**-23
    assert noise.min().item() > 0.0 and noise.max().item() < 1.0
    assert abs(noise.mean().item() - 0.5) < 0.02


def test_unsigned_64_bit_seeds_wrap_onto_int64() -> None:
    seeds = [2**64 - 1, -1, 2**63, 5]
    batch = SamplingBatch.build([make_request(SamplingParams(), seed=s) for s in seeds], 8, CPU)
    assert batch.seeds.tolist() == [-1, -1, -(2**63), 5]
    assert len(Sampler()(BASE_LOGITS.expand(4, -1).clone(), batch).token_ids) == 4


def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> list[float]:
    result = list(logits)
    for token in set(prompt) | set(output):
        result[token] = result[token] / rep if result[token] > 0 else result[token] * rep
    for token in set(output):
        result[token] -= freq * output.count(token) + pres
    return result


def test_penalties_match_a_straightforward_reference() -> None:
    vocab = 12
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)) * 3
    rows = [
        (SamplingParams(repetition_penalty=1.3), [1, 2, 2], [3, 1, 4, 4]),
        (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), [5], [6, 6, 6, 0]),
        (
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5),
            [9, 10],
            [10, 11],
        ),
    ]
    requests = [make_request(p, prompt=prompt, output=out) for p, prompt, out in rows]
    batch = SamplingBatch.build(requests, vocab, CPU)
    got = apply_penalties(logits, batch)
    for row, (p, prompt, out) in enumerate(rows):
        want = reference_penalties(
            logits[row].tolist(), prompt, out, p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        )
        torch.testing.assert_close(got[row], torch.tensor(want))


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert sample(logits, [make_request(params, output=[])]) == [1]
    assert sample(logits, [make_request(params, output=[1])]) == [2]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_suppresses_eos_and_stop_ids(ignore_eos: bool) -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 6.0]])  # EOS (7) > stop id 2 > 3
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,), ignore_eos=ignore_eos)
    early = sample(logits, [make_request(params, output=[0])])
    assert early == ([7] if ignore_eos else [3])
    assert sample(logits, [make_request(params, output=[0, 0])]) == [7]


def test_min_tokens_suppression_holds_for_sampled_rows() -> None:
    logits = torch.zeros(500, 8)
    params = SamplingParams(min_tokens=5, stop_token_ids=(3,))
    tokens = sample(logits, [make_request(params, seed=s) for s in range(500)])
    assert EOS not in tokens and 3 not in tokens
    assert set(tokens) == {0, 1, 2, 4, 5, 6}


def test_logprobs_come_from_the_raw_distribution() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(9))
    requests = [
        make_request(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0), output=[5]),
        make_request(SamplingParams(temperature=0.6, top_k=4, logprobs=0), seed=3),
        make_request(SamplingParams(temperature=1.0)),
        make_request(SamplingParams(temperature=1.2, logprobs=5, presence_penalty=1.0), output=[2]),
    ]
    out = Sampler()(logits, SamplingBatch.build(requests, 30, CPU))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(raw[row, token].item(), abs=1e-6)
    for row, k in enumerate([3, 0, 0, 5]):
        values, indices = raw[row].topk(k) if k else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in out.top_logprobs[row]] == indices.tolist()
        assert [lp for _, lp in out.top_logprobs[row]] == pytest.approx(values.tolist(), abs=1e-6)


def test_no_logprobs_when_nobody_asks() -> None:
    out = Sampler()(BASE_LOGITS.unsqueeze(0), SamplingBatch.build([make_request(SamplingParams())], 8, CPU))
    assert out.logprobs is None and out.top_logprobs is None


def test_mixed_batch_of_greedy_and_sampled_rows() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(11))
    params = [SamplingParams(temperature=t, top_p=0.9) for t in (0.0, 1.0, 0.0, 0.7, 1.5, 0.0)]
    requests = [make_request(p, seed=i) for i, p in enumerate(params)]
    mixed = sample(logits, requests)
    for row, request in enumerate(requests):
        alone = sample(logits[row : row + 1], [request])[0]
        assert mixed[row] == alone
        if params[row].temperature == 0.0:
            assert alone == logits[row].argmax().item()


def test_logits_of_the_wrong_shape_are_rejected() -> None:
    batch = SamplingBatch.build([make_request(SamplingParams())], 8, CPU)
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.zeros(1, 9), batch)
