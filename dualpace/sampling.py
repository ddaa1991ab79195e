"""Sampling parameters, token sampling and stop conditions.

Sampling is deterministic per (seed, position): the random draw for the token
at absolute position p of a sequence depends only on the request's seed and p,
so a request continued on another engine samples exactly what it would have
sampled without moving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dualpace.logits_processing import apply_penalties, raw_log_probs, token_logprobs
from dualpace.logprobs import TokenLogprobs
from dualpace.model import cpu_kernels
from dualpace.penalties import SamplingContext
from dualpace.sampling_params import MAX_SEED, FinishReason, SamplingParams, stop_reason  # noqa: F401 (re-exported)

MAX_POSITION = 2**63 - 1

_MASK32 = 0xFFFFFFFF
# Numbers of largest probabilities examined, in turn, when finding a nucleus
# (top-p) cut-off; rows whose nucleus is larger still get a full sort. Exact.
_NUCLEUS_PREFIXES = (1024, 8192)
# Uniforms carry 23 random bits, u in [2^-24, 1 - 2^-24], so the Gumbel noise
# -log(-log u) lies in about [-2.82, 16.64]. A token whose log-probability is more
# than 19.5 below the best kept token can therefore never win the race; such
# tokens are skipped without changing any outcome. 24 leaves a rounding margin.
_GUMBEL_WINDOW = 24.0
_UNIFORM_BITS = 23


@dataclass(frozen=True)
class SampleResult:
    """Next tokens of one batch, one entry per row.

    A row whose logits held NaN or +-inf has finite False and token id -1; the
    caller finishes that request with FinishReason.ERROR.
    """

    token_ids: list[int]
    finite: list[bool]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per row (None where not asked); [] when no row asked


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
    contexts: Sequence[SamplingContext | None] | None = None,
) -> SampleResult:
    """Choose the next token of every row of logits [num_rows, vocab_size].

    positions[i] is the absolute position in its sequence of the token being
    chosen (the number of tokens before it, prompt included). A sampled row's
    draw depends only on (seeds[i], positions[i]) and its filtered distribution,
    never on the batch, the row index or global state. Greedy rows (temperature
    0) take the argmax (the lowest id among ties). Computation is in float32
    whatever the dtype of logits, on the device of logits. contexts[i] carries what row i's
    penalties need (dualpace.penalties); logprobs come from the logits before any of that.
    """
    _check_batch(logits, params, seeds, positions)
    if logits.shape[0] == 0:
        return SampleResult(token_ids=[], finite=[])
    scores = logits.float()
    finite = all_finite_rows(scores)
    all_finite = bool(finite.all())
    if not all_finite:
        scores = scores.masked_fill(~finite[:, None], 0.0)
    logprob_rows, log_probs = raw_log_probs(scores, params)
    if contexts is not None:
        scores = apply_penalties(scores, params, contexts)
    token_ids = first_max_ids(scores)
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled_rows:
        row_index = torch.tensor(sampled_rows, device=scores.device)
        token_ids[row_index] = _sample_rows(
            scores[row_index],
            [params[i] for i in sampled_rows],
            [seeds[i] for i in sampled_rows],
            [positions[i] for i in sampled_rows],
        )
    if not all_finite:
        token_ids = torch.where(finite, token_ids, torch.full_like(token_ids, -1))
    ids, finite_rows = token_ids.tolist(), finite.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(ids) if log_probs is not None else []
    if log_probs is not None:
        entries = token_logprobs(log_probs, [max(ids[i], 0) for i in logprob_rows],
                                 [params[i].logprobs for i in logprob_rows])
        for row, entry in zip(logprob_rows, entries):
            logprobs[row] = entry if finite_rows[row] else None
    return SampleResult(token_ids=ids, finite=finite_rows, logprobs=logprobs)


def all_finite_rows(scores: torch.Tensor) -> torch.Tensor:
    """Whether each row of scores is all finite: its max and min are (both carry a NaN or an inf).
    Two plain reductions instead of torch.isfinite(scores).all(dim=1), which built a boolean copy
    and reduced it at a tenth of the speed (batch 1 / 8 / 32 x 49,152: 59 / 518 / 2050 us against
    12 / 31 / 220, 2 threads, Intel Xeon with AMX)."""
    return torch.isfinite(scores.amax(dim=1)) & torch.isfinite(scores.amin(dim=1))


def first_max_ids(scores: torch.Tensor) -> torch.Tensor:
    """The column of each row's maximum, the lowest among ties: what argmax(dim=1) returns. On the
    CPU the kernels' one pass per row where they are loaded (float32 rows without NaN), since torch's
    index-tracking reductions are slow there; elsewhere torch.max(dim=1), faster than argmax."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.shape[0] > 0:
        kernels = cpu_kernels.get()
        ids = None if kernels is None else kernels.first_max_ids(scores)
        if ids is not None:
            return ids
    return scores.max(dim=1).indices


def _check_batch(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int]
) -> None:
    """Raise ValueError when the batch arguments do not fit together."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor, got {tuple(logits.shape)} {logits.dtype}")
    num_rows = logits.shape[0]
    if not len(params) == len(seeds) == len(positions) == num_rows:
        raise ValueError(
            f"{num_rows} logit rows but {len(params)} params, {len(seeds)} seeds, {len(positions)} positions"
        )
    if logits.shape[1] == 0:
        raise ValueError("logits have an empty vocabulary")
    for seed in seeds:
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed {seed} is outside [0, 2^63 - 1]")
    for position in positions:
        if not 0 <= position <= MAX_POSITION:
            raise ValueError(f"position {position} is outside [0, 2^63 - 1]")


def _sample_rows(
    scores: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int]
) -> torch.Tensor:
    """Draw one token per row of finite float32 scores [num_rows, vocab_size].

    Gumbel-max: the winner is argmax(log p + g) over kept tokens, where g is
    Gumbel noise hashed from (seed, position, token id).
    """
    device = scores.device
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    temperatures = temperatures.clamp_min(torch.finfo(torch.float32).tiny)
    # Shift before dividing so that a tiny temperature cannot overflow: the best
    # token scores 0 and every other is <= 0 (or -inf).
    scaled = (scores - scores.max(dim=1, keepdim=True).values) / temperatures[:, None]
    keep = _filter_mask(scaled, params)
    log_probs = torch.log_softmax(scaled.masked_fill(~keep, -math.inf), dim=1)
    # The best kept token has scaled 0: this keeps every token that can win.
    candidates = keep & (scaled >= -_GUMBEL_WINDOW)
    column_ids = candidates.any(dim=0).nonzero(as_tuple=True)[0]
    if column_ids.numel() < scaled.shape[1]:  # work only on columns some row can pick
        candidates = candidates[:, column_ids]
        log_probs = log_probs[:, column_ids]
    race = log_probs.add_(_gumbel_noise(_token_hashes(_row_keys(seeds, positions, device), column_ids)))
    race.masked_fill_(~candidates, -math.inf)
    return column_ids[first_max_ids(race)]


def _filter_mask(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Boolean [num_rows, vocab_size]: tokens that survive top-k, top-p and min-p.

    Cut-offs are value thresholds, so tokens tied with the last kept one are kept
    too; the best token always survives.
    """
    device = scaled.device
    vocab_size = scaled.shape[1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    top_ks = [min(p.top_k, vocab_size) for p in params]
    if any(top_ks):
        k = torch.tensor(top_ks, device=device)
        top_values = torch.topk(scaled, max(top_ks), dim=1).values
        kth_values = top_values.gather(1, (k - 1).clamp_min(0)[:, None]).squeeze(1)
        kth_values = torch.where(k > 0, kth_values, torch.full_like(kth_values, -math.inf))
        keep &= scaled >= kth_values[:, None]
    top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    nucleus_rows = (top_ps < 1.0).nonzero(as_tuple=True)[0]
    if nucleus_rows.numel() > 0:
        probs = torch.softmax(scaled[nucleus_rows].masked_fill(~keep[nucleus_rows], -math.inf), dim=1)
        thresholds = _nucleus_thresholds(probs, top_ps[nucleus_rows])
        keep[nucleus_rows] &= probs >= thresholds[:, None]
    if any(p.min_p > 0.0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        # scaled is log(p / p_max), so exp(scaled) < min_p is "p < min_p * p_max".
        keep &= scaled.exp() >= min_ps[:, None]
    return keep


def _nucleus_thresholds(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability inside the nucleus of mass >= top_p.

    Looks at the largest probabilities first (cheap partial top-k) and only rows
    whose nucleus is larger go on to a longer prefix, finally a full sort.
    """
    vocab_size = probs.shape[1]
    thresholds = torch.empty_like(top_ps)
    pending_rows = torch.arange(probs.shape[0], device=probs.device)
    for num_prefix in (*_NUCLEUS_PREFIXES, vocab_size):
        if num_prefix >= vocab_size:
            prefix = torch.sort(probs[pending_rows], dim=1, descending=True).values
        else:
            prefix = torch.topk(probs[pending_rows], num_prefix, dim=1).values
        row_thresholds, complete = _prefix_thresholds(prefix, top_ps[pending_rows])
        thresholds[pending_rows] = row_thresholds
        if num_prefix >= vocab_size:
            break
        pending_rows = pending_rows[~complete]
        if pending_rows.numel() == 0:
            break
    return thresholds


def _prefix_thresholds(sorted_probs: torch.Tensor, top_ps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Nucleus threshold within descending sorted_probs, and whether it was reached.

    A token is in the nucleus when the mass strictly before it is < top_p, so the
    best token always is. Not reached means every given token is inside and the
    nucleus may extend past them.
    """
    cumulative = sorted_probs.cumsum(dim=1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    num_inside = (mass_before < top_ps[:, None]).sum(dim=1)
    thresholds = sorted_probs.gather(1, (num_inside - 1)[:, None]).squeeze(1)
    return thresholds, num_inside < sorted_probs.shape[1]


def _row_keys(seeds: Sequence[int], positions: Sequence[int], device: torch.device) -> torch.Tensor:
    """A 32-bit key per row mixing both halves of the seed and of the position.

    For a fixed seed, distinct positions below 2^32 get distinct keys.
    """
    seed_values = torch.tensor(list(seeds), dtype=torch.int64, device=device)
    position_values = torch.tensor(list(positions), dtype=torch.int64, device=device)
    keys = _fmix32((seed_values & _MASK32) ^ 0x243F6A88)
    keys = _fmix32(keys ^ (seed_values >> 32))
    keys = _fmix32(keys ^ (position_values & _MASK32))
    return _fmix32(keys ^ (position_values >> 32))


def _token_hashes(row_keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """32-bit hashes [num_rows, num_vocab_ids] of every (row key, vocabulary id) pair."""
    vocab_hashes = _fmix32(vocab_ids.to(torch.int64) ^ 0x85A308D3)
    return _fmix32(vocab_hashes[None, :] ^ row_keys[:, None])


def _gumbel_noise(hashes: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise -log(-log u) in float32, u uniform in (0, 1) from hashes.

    u = (top 23 bits + 0.5) / 2^23 is exact in float32 and never 0 or 1.
    """
    uniforms = (hashes >> (32 - _UNIFORM_BITS)).to(torch.float32)
    uniforms.add_(0.5).mul_(2.0**-_UNIFORM_BITS)
    return uniforms.log_().neg_().log_().neg_()


def _fmix32(values: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values < 2^32."""
    values = values ^ (values >> 16)
    values = _mul32(values, 0x85EBCA6B)
    values ^= values >> 13
    values = _mul32(values, 0xC2B2AE35)
    values ^= values >> 16
    return values


def _mul32(values: torch.Tensor, multiplier: int) -> torch.Tensor:
    """values * multiplier mod 2^32 for values < 2^32, in int64 without overflow.

    A multiplier >= 2^31 is replaced by multiplier - 2^32 (same residue, and
    |values * it| < 2^63); masking the two's-complement product gives the residue.
    """
    signed_multiplier = multiplier - 2**32 if multiplier >= 2**31 else multiplier
    product = values * signed_multiplier
    product &= _MASK32
    return product
