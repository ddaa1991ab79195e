"""Sampling: greedy, seeded determinism, filters, non-finite rows, validation, stops."""

from __future__ import annotations

import math

import pytest
import torch

from dualpace.errors import InvalidArgument
from dualpace.validation import validate_request
from dualpace.sampling import (
    MAX_SEED,
    FinishReason,
    SampleResult,
    SamplingParams,
    _fmix32,
    sample_next_tokens,
    stop_reason,
)

HOT = SamplingParams(temperature=1.0)


def _logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale


def _draws(logits_row: torch.Tensor, params: SamplingParams, seed: int, positions: list[int]) -> list[int]:
    """Sample one row at many positions in a single batch (one row per position)."""
    batch = logits_row[None, :].expand(len(positions), -1)
    return sample_next_tokens(batch, [params] * len(positions), [seed] * len(positions), positions).token_ids


def test_greedy_is_argmax_and_ignores_seed() -> None:
    logits = _logits(8, 100, scale=3.0)
    expected = logits.argmax(dim=1).tolist()
    for seed in (0, 7, MAX_SEED):
        result = sample_next_tokens(logits, [SamplingParams()] * 8, [seed] * 8, list(range(8)))
        assert result == SampleResult(token_ids=expected, finite=[True] * 8)


def test_greedy_tie_takes_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    assert sample_next_tokens(logits, [SamplingParams()], [0], [0]).token_ids == [1]


def test_empty_batch() -> None:
    assert sample_next_tokens(torch.zeros(0, 5), [], [], []) == SampleResult([], [])


def test_same_seed_same_tokens() -> None:
    row = _logits(1, 50)[0]
    first = _draws(row, HOT, 1234, list(range(300)))
    assert _draws(row, HOT, 1234, list(range(300))) == first
    assert len(set(first)) > 10  # really sampling, not constant


def test_different_seeds_differ() -> None:
    row = torch.zeros(8)
    positions = list(range(400))
    streams = [_draws(row, HOT, seed, positions) for seed in (1, 2, 2**32 + 1, MAX_SEED)]
    for i in range(len(streams)):
        for j in range(i + 1, len(streams)):
            num_equal = sum(a == b for a, b in zip(streams[i], streams[j]))
            assert num_equal < 100  # independent streams agree about 1/8 of the time
    for stream in streams:  # each stream still covers the whole flat vocabulary
        assert set(stream) == set(range(8))


def test_batch_independence() -> None:
    """A row sampled alone or at any index of a mixed batch gives the same token."""
    vocab_size = 2000
    logits = _logits(6, vocab_size, seed=3, scale=2.0)
    params = [
        HOT,
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(),
        SamplingParams(temperature=0.9, top_k=100, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=2.0, min_p=0.1),
    ]
    seeds = [11, 22, 33, 44, 55, 66]
    for position in (0, 5, 77):
        positions = [position + i for i in range(6)]
        batched = sample_next_tokens(logits, params, seeds, positions).token_ids
        reversed_batch = sample_next_tokens(logits.flip(0), params[::-1], seeds[::-1], positions[::-1]).token_ids
        assert reversed_batch[::-1] == batched
        for i in range(6):
            alone = sample_next_tokens(logits[i : i + 1], [params[i]], [seeds[i]], [positions[i]]).token_ids
            assert alone == [batched[i]]


def test_positions_continue_the_stream() -> None:
    """Continuing at position p (e.g. on another engine) reproduces the same draws."""
    row = _logits(1, 30)[0]
    uninterrupted = [_draws(row, HOT, 99, [p])[0] for p in range(40)]
    continued = _draws(row, HOT, 99, list(range(25, 40)))
    assert continued == uninterrupted[25:]
    assert len(set(uninterrupted)) > 5  # the draw changes with the position


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize(("temperature", "vary"), [(1.0, "position"), (0.5, "position"), (1.0, "seed")])
def test_empirical_distribution_matches_softmax(temperature: float, vary: str) -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 0.7, -1.0, 0.2])
    probs = torch.softmax(logits / temperature, dim=0).tolist()
    num_draws = 6000
    params = [SamplingParams(temperature=temperature)] * num_draws
    batch = logits[None, :].expand(num_draws, -1)
    if vary == "position":
        token_ids = sample_next_tokens(batch, params, [2024] * num_draws, list(range(num_draws))).token_ids
    else:
        seeds = [2**40 + 3 * i for i in range(num_draws)]
        token_ids = sample_next_tokens(batch, params, seeds, [17] * num_draws).token_ids
    counts = [token_ids.count(i) for i in range(6)]
    # 5 degrees of freedom: P(chi2 > 25) is about 1e-4; the draws are fixed anyway.
    assert _chi_square(counts, probs) < 25.0


@pytest.mark.parametrize("vary", ["position", "seed"])
def test_neighbouring_draws_are_independent(vary: str) -> None:
    """Pairs of draws at neighbouring positions (or seeds) are uniform over 4 x 4."""
    num_draws = 8000
    batch = torch.zeros(1, 4).expand(num_draws, -1)
    params = [HOT] * num_draws
    if vary == "position":
        token_ids = sample_next_tokens(batch, params, [7] * num_draws, list(range(num_draws))).token_ids
    else:
        token_ids = sample_next_tokens(batch, params, list(range(num_draws)), [0] * num_draws).token_ids
    pairs = list(zip(token_ids[:-1], token_ids[1:]))
    counts = [pairs.count((a, b)) for a in range(4) for b in range(4)]
    assert _chi_square(counts, [1 / 16] * 16) < 40.0  # 15 degrees of freedom


def test_hash_matches_murmur3_fmix32() -> None:
    """The int64 tensor hash equals the 32-bit reference (no overflow, exact wrap)."""

    def reference(value: int) -> int:
        value ^= value >> 16
        value = (value * 0x85EBCA6B) & 0xFFFFFFFF
        value ^= value >> 13
        value = (value * 0xC2B2AE35) & 0xFFFFFFFF
        return value ^ (value >> 16)

    generator = torch.Generator().manual_seed(1)
    values = torch.randint(0, 2**32, (2000,), dtype=torch.int64, generator=generator).tolist()
    values += [0, 1, 2**31 - 1, 2**31, 2**32 - 1]
    assert _fmix32(torch.tensor(values)).tolist() == [reference(v) for v in values]


def test_top_p_renormalises_the_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    token_ids = _draws(logits, SamplingParams(temperature=1.0, top_p=0.75), 5, list(range(4000)))
    counts = [token_ids.count(i) for i in range(4)]
    assert counts[2] == counts[3] == 0
    assert _chi_square(counts[:2], [0.5 / 0.8, 0.3 / 0.8]) < 15.0


@pytest.mark.parametrize(
    ("params", "allowed_ids"),
    [
        (SamplingParams(temperature=1.0, top_p=0.75), {0, 1}),
        (SamplingParams(temperature=1.0, top_p=0.85), {0, 1, 2}),
        (SamplingParams(temperature=1.0, top_p=1e-6), {0}),
        (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        (SamplingParams(temperature=1.0, top_k=1), {0}),
        (SamplingParams(temperature=1.0, min_p=0.2), {0, 1, 2}),
        (SamplingParams(temperature=1.0, min_p=1.0), {0}),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.6), {0, 1}),
    ],
)
def test_filters_keep_exactly_the_allowed_tokens(params: SamplingParams, allowed_ids: set[int]) -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(_draws(logits, params, 8, list(range(1500)))) == allowed_ids


def test_top_k_on_random_logits() -> None:
    logits = _logits(1, 500, seed=4)[0]
    top_ids = set(torch.topk(logits, 5).indices.tolist())
    drawn = _draws(logits, SamplingParams(temperature=5.0, top_k=5), 3, list(range(500)))
    assert set(drawn) == top_ids


def test_top_p_beyond_the_prefix_uses_the_full_sort() -> None:
    """A nucleus of thousands of tokens (more than the fast prefix) is cut exactly."""
    vocab_size = 3000
    logits = torch.linspace(0.0, 1.0, vocab_size)  # nearly flat, highest id is best
    probs = torch.softmax(logits.double(), dim=0).flip(0)
    num_inside = int((probs.cumsum(0) - probs < 0.5).sum())
    assert num_inside > 1024
    drawn = _draws(logits, SamplingParams(temperature=1.0, top_p=0.5), 1, list(range(400)))
    assert min(drawn) >= vocab_size - num_inside - 1
    assert min(drawn) < vocab_size - 0.8 * num_inside  # the nucleus is really used


def test_tiny_and_huge_temperature() -> None:
    logits = _logits(3, 64, seed=5, scale=2.0)
    params = [SamplingParams(temperature=1e-30)] * 3
    result = sample_next_tokens(logits, params, [1, 2, 3], [0, 1, 2])
    assert result.token_ids == logits.argmax(dim=1).tolist()
    drawn = _draws(logits[0], SamplingParams(temperature=1e30), 1, list(range(2000)))
    assert len(set(drawn)) == 64  # effectively uniform


def test_non_finite_rows_are_flagged_and_isolated() -> None:
    logits = _logits(5, 40, seed=6)
    params = [HOT, SamplingParams(), HOT, SamplingParams(temperature=0.5, top_p=0.9), HOT]
    seeds, positions = [1, 2, 3, 4, 5], [10, 11, 12, 13, 14]
    clean = sample_next_tokens(logits, params, seeds, positions)
    poisoned = logits.clone()
    poisoned[1, 3] = math.nan
    poisoned[2, 0] = math.inf
    poisoned[4, 39] = -math.inf
    result = sample_next_tokens(poisoned, params, seeds, positions)
    assert result.finite == [True, False, False, True, False]
    assert result.token_ids[1] == result.token_ids[2] == result.token_ids[4] == -1
    assert result.token_ids[0] == clean.token_ids[0]
    assert result.token_ids[3] == clean.token_ids[3]


def test_bf16_logits_match_their_float32_values() -> None:
    logits = _logits(4, 300, seed=7, scale=3.0).to(torch.bfloat16)
    params = [
        SamplingParams(),
        HOT,
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.7),
    ]
    seeds, positions = [1, 2, 3, 4], [0, 1, 2, 3]
    from_bf16 = sample_next_tokens(logits, params, seeds, positions)
    from_fp32 = sample_next_tokens(logits.float(), params, seeds, positions)
    assert from_bf16 == from_fp32
    assert all(0 <= t < 300 for t in from_bf16.token_ids)


def test_batch_argument_errors() -> None:
    with pytest.raises(ValueError):
        sample_next_tokens(torch.zeros(2, 4), [HOT], [1, 2], [0, 0])
    with pytest.raises(ValueError):
        sample_next_tokens(torch.zeros(1, 4), [HOT], [-1], [0])
    with pytest.raises(ValueError):
        sample_next_tokens(torch.zeros(1, 4), [HOT], [MAX_SEED + 1], [0])
    with pytest.raises(ValueError):
        sample_next_tokens(torch.zeros(4), [HOT], [1], [0])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=2.0), "min_p"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(seed=MAX_SEED + 1), "seed"),
        (SamplingParams(stop=("",)), "stop"),
    ],
)
def test_validate_names_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        params.validate()
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}:")


def test_validate_stop_token_ids_against_vocab() -> None:
    params = SamplingParams(stop_token_ids=(5, 10))
    assert params.validate(vocab_size=11) is params
    with pytest.raises(InvalidArgument) as caught:
        params.validate(vocab_size=10)
    assert caught.value.field == "stop_token_ids"


@pytest.mark.parametrize("prompt, bad", [([1, 2, 10, 3], (10, 2)), ([0, -1, 12], (-1, 1)), ([9, 9, 11], (11, 2))])
def test_validate_request_names_the_first_token_outside_the_vocabulary(prompt, bad) -> None:
    validate_request([0, 9, 3], SamplingParams(max_tokens=4), vocab_size=10, max_context_tokens=16)
    with pytest.raises(InvalidArgument) as caught:
        validate_request(prompt, SamplingParams(max_tokens=4), vocab_size=10, max_context_tokens=16, prompt_field="p")
    assert caught.value.field == "p"
    assert f"token id {bad[0]} at index {bad[1]} is outside the vocabulary [0, 10)" in str(caught.value)


def test_stop_reason() -> None:
    eos = {2}
    plain = SamplingParams(max_tokens=5, stop_token_ids=(7,))
    assert stop_reason(3, 1, plain, eos) is None
    assert stop_reason(2, 1, plain, eos) is FinishReason.STOP
    assert stop_reason(7, 1, plain, eos) is FinishReason.STOP
    assert stop_reason(3, 5, plain, eos) is FinishReason.LENGTH
    assert stop_reason(2, 5, plain, eos) is FinishReason.STOP  # a stop wins over length
    no_eos = SamplingParams(max_tokens=5, stop_token_ids=(7,), ignore_eos=True)
    assert stop_reason(2, 1, no_eos, eos) is None
    assert stop_reason(7, 1, no_eos, eos) is FinishReason.STOP
    assert stop_reason(2, 5, no_eos, eos) is FinishReason.LENGTH


@pytest.mark.parametrize("rows,vocab", [(1, 151936), (3, 49152), (8, 1000), (2, 17)])
def test_first_max_ids_is_torch_max_index_ties_lowest(rows, vocab):
    """The CPU kernels' one-pass argmax (where loaded) returns torch.max(dim=1)'s index: the lowest
    column among ties, also for a strided view and rows of -inf; a row holding a NaN gets torch's."""
    from dualpace.sampling import first_max_ids

    scores = torch.randn(rows, vocab + 3, generator=torch.Generator().manual_seed(rows))[:, :vocab]
    top = float(scores.max()) + 1.0
    scores[:, vocab // 2] = top
    scores[:, vocab - 1] = top
    scores[0, 0] = top  # row 0's first column ties too
    assert torch.equal(first_max_ids(scores), scores.max(dim=1).indices)
    scores[-1] = float("-inf")
    assert torch.equal(first_max_ids(scores), scores.max(dim=1).indices)
    scores[-1, 3] = float("nan")
    assert torch.equal(first_max_ids(scores), scores.max(dim=1).indices)
