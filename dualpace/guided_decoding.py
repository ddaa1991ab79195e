"""Structured outputs: a request's GuidedSpec as a grammar, and the token mask it allows next.

The grammar engine is llguidance (a Rust library with no Python dependencies): it compiles JSON
Schemas, regular expressions and Lark grammars, and computes the set of tokens that keep the
output inside the grammar, on the CPU, in tens of microseconds a token, releasing the GIL.

`GuidedMasks` is the engine's side. A step's masks depend only on the tokens generated so far,
which are known before the step's forward pass, so `start` computes them on a worker thread while
the model runs and `apply` waits for them after it: off the critical path unless the mask takes
longer than the forward pass. Nothing about a matcher is ever shipped: the state is a cache,
rebuilt from a sequence's `guided_token_ids` whenever it is missing or stale, which is how it
follows a request that migrated, recovered on another engine or was preempted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from dualpace.guided_grammar import grammar_for
from dualpace.guided_spec import GuidedSpec

log = logging.getLogger(__name__)

# Logit given to a token the grammar forbids: finite (the sampler treats a non-finite row as a
# failed step) yet far below any real logit, so neither argmax nor the Gumbel race can pick it.
FORBIDDEN_LOGIT = -1e30
MAX_CACHED_MATCHERS = 256  # per engine; a dropped matcher is rebuilt from the tokens when needed
MAX_CACHED_GRAMMARS = 32  # compiled, unstarted matchers kept per distinct spec


@dataclass
class _Matcher:
    spec: GuidedSpec
    matcher: llguidance.LLMatcher
    num_consumed: int = 0  # guided tokens consumed so far
    last_token_id: int | None = None  # the last one, to notice a sequence whose tokens changed


@dataclass(frozen=True)
class GuidedRow:
    """What a mask needs from one sampled sequence of a step."""

    request_id: str
    spec: GuidedSpec
    token_ids: tuple[int, ...]  # generated under the constraint so far (guided_token_ids)
    stop_token_ids: tuple[int, ...]  # also allowed wherever the grammar allows EOS


class GuidedMasks:
    """One engine's matchers and the masks of its guided rows, computed on a worker thread."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self._tokenizer = tokenizer  # dualpace.model.tokenizer.Tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[GuidedSpec, llguidance.LLMatcher] = OrderedDict()
        self._matchers: OrderedDict[str, _Matcher] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="guided-masks")
        # Building llguidance's view of the vocabulary takes seconds on a 50k vocabulary: it starts
        # now, in the background, so the first constrained request does not stall a step for it.
        self._tokenizer_ready = self._pool.submit(self._build_tokenizer)

    def start(self, rows: Sequence[GuidedRow], vocab_size: int) -> Future:
        """Begin computing the masks [len(rows), vocab_size] (bool, True: allowed)."""
        return self._pool.submit(self._masks, list(rows), vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- on the worker thread ---------------------------------------------

    def _build_tokenizer(self) -> None:
        try:
            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend.to_str(),
                                                        n_vocab=self._tokenizer.vocab_size,
                                                        eos_token=self._eos_token_ids)
        except Exception:  # noqa: BLE001 (any failure: constrained requests then fail alone)
            log.exception("llguidance cannot use this tokenizer: constrained requests will fail")

    def _masks(self, rows: list[GuidedRow], vocab_size: int) -> torch.Tensor:
        """Allowed tokens per row; a row whose constraint cannot be followed allows none."""
        masks = torch.zeros((len(rows), vocab_size), dtype=torch.bool)
        if self._ll_tokenizer is None:
            return masks
        for index, row in enumerate(rows):
            state = self._state(row)
            if state.matcher.is_error():
                log.warning("request %s: its constraint failed (%s); forbidding every token", row.request_id,
                            state.matcher.get_error())
                continue  # an all-forbidden row: apply() turns it into a failed (non-finite) row
            allowed = self._unpack(state.matcher.compute_bitmask(), vocab_size)
            if row.stop_token_ids and any(allowed[t] for t in self._eos_token_ids if t < vocab_size):
                allowed[[t for t in row.stop_token_ids if t < vocab_size]] = True
            masks[index] = allowed
        return masks

    def _state(self, row: GuidedRow) -> _Matcher:
        """The request's matcher after exactly row.token_ids, rebuilt when stale."""
        state = self._matchers.get(row.request_id)
        stale = (state is None or state.spec != row.spec or state.num_consumed > len(row.token_ids)
                 or (state.num_consumed and row.token_ids[state.num_consumed - 1] != state.last_token_id))
        if stale:
            state = _Matcher(row.spec, self._fresh(row.spec))
            self._matchers[row.request_id] = state
        self._matchers.move_to_end(row.request_id)
        while len(self._matchers) > MAX_CACHED_MATCHERS:
            self._matchers.popitem(last=False)
        new_ids = list(row.token_ids[state.num_consumed:])
        if new_ids:
            state.matcher.consume_tokens(new_ids)  # on failure the matcher is in its error state
            state.num_consumed = len(row.token_ids)
            state.last_token_id = row.token_ids[-1]
        return state

    def _fresh(self, spec: GuidedSpec) -> llguidance.LLMatcher:
        key = GuidedSpec(spec.kind, spec.spec)  # the grammar does not depend on the prompt offset
        compiled = self._grammars.get(key)
        if compiled is None:
            try:
                grammar = grammar_for(spec)
            except ValueError as exc:  # the router checks specs; a direct gRPC client may not have
                grammar = llguidance.LLMatcher.grammar_from_regex("")
                log.warning("unusable %s constraint: %s", spec.kind.value, exc)
            compiled = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
            self._grammars[key] = compiled
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        self._grammars.move_to_end(key)
        return compiled.deep_copy()

    @staticmethod
    def _unpack(bitmask: bytes, vocab_size: int) -> torch.Tensor:
        """llguidance's bitmask (bit i of 32-bit word i // 32, little-endian) as bools [vocab_size];
        ids past the tokenizer's vocabulary (padded embedding rows) are forbidden."""
        bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        num_known = min(vocab_size, bits.shape[0])
        allowed[:num_known] = torch.from_numpy(bits[:num_known].astype(np.bool_))
        return allowed


def apply_masks(logits: torch.Tensor, row_indices: Sequence[int], masks: torch.Tensor) -> torch.Tensor:
    """A float32 copy of logits with forbidden tokens of the given rows set to FORBIDDEN_LOGIT; a row
    with nothing allowed (its constraint failed) becomes NaN, so the sampler fails it alone."""
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    index = torch.tensor(list(row_indices), dtype=torch.long, device=out.device)
    allowed = masks.to(out.device)
    rows = out.index_select(0, index).masked_fill_(~allowed, FORBIDDEN_LOGIT)
    rows[~allowed.any(dim=1)] = float("nan")
    out.index_copy_(0, index, rows)
    return out
