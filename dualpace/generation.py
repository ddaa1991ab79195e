"""Single-process generation: the model core, paged KV and the sampler in one loop.

This is the reference path every engine is compared with (`dualpace generate`):
all prompts are prefilled in one step, then decoded together until each stops.
The KV pool is sized so that every sequence fits, so nothing is preempted here;
the engine daemons add scheduling, preemption and migration on the same pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dualpace.kv.block_table import KVBlockManager
from dualpace.kv.storage import KVStorage
from dualpace.model.loader import LoadedModel
from dualpace.model.paged_forward import PagedForward, SequenceWork
from dualpace.penalties import context_for
from dualpace.sampling import FinishReason, SamplingParams, sample_next_tokens, stop_reason
from dualpace.sampling_params import pick_seed
from dualpace.validation import validate_request

DEFAULT_BLOCK_SIZE = 16


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_sequences_prefilled: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decode steps (the first token comes from prefill)."""
        decoded = self.num_generated_tokens - self.num_sequences_prefilled
        return decoded / self.decode_s if self.decode_s > 0 else 0.0


class OfflineGenerator:
    """Generates for a fixed set of prompts with a KV pool sized to fit them all."""

    def __init__(self, loaded: LoadedModel, block_size: int = DEFAULT_BLOCK_SIZE):
        self.loaded = loaded
        self.block_size = block_size
        self.stats = GenerationStats()

    def _eos_token_ids(self, extra: tuple[int, ...]) -> set[int]:
        return set(self.loaded.config.eos_token_ids) | set(self.loaded.tokenizer.eos_token_ids) | set(extra)

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        extra_eos_token_ids: tuple[int, ...] = (),
        on_step: Callable[[list[Sequence]], None] | None = None,
    ) -> list[Sequence]:
        cfg = self.loaded.config
        for prompt, p in zip(prompts, params, strict=True):
            validate_request(prompt, p, cfg.vocab_size, self.loaded.max_context_tokens)
        sequences = [Sequence(i, list(prompt), p, pick_seed(p)) for i, (prompt, p) in enumerate(zip(prompts, params))]
        blocks = KVBlockManager(
            num_blocks=sum(-(-(len(s.prompt_token_ids) + s.params.max_tokens) // self.block_size) for s in sequences),
            block_size=self.block_size,
        )
        model = self.loaded.model
        kv = KVStorage(cfg.num_layers, blocks.num_total_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                       model.dtype, model.device)
        forward = PagedForward(model, kv)
        eos_ids = self._eos_token_ids(extra_eos_token_ids)
        self.stats = stats = GenerationStats(num_prompt_tokens=sum(len(p) for p in prompts),
                                             num_sequences_prefilled=len(sequences))

        start = time.perf_counter()
        for seq in sequences:
            blocks.allocate(seq.seq_id, len(seq.prompt_token_ids))
        work = [SequenceWork(s.prompt_token_ids, 0, blocks.block_ids(s.seq_id)) for s in sequences]
        self._sample_and_append(forward.forward(work), sequences, eos_ids)
        stats.prefill_s = time.perf_counter() - start
        if on_step:
            on_step(sequences)

        start = time.perf_counter()
        while running := [s for s in sequences if s.finish_reason is None]:
            work = []
            for seq in running:
                blocks.append(seq.seq_id, 1)
                work.append(SequenceWork([seq.output_token_ids[-1]], seq.num_tokens - 1, blocks.block_ids(seq.seq_id)))
            self._sample_and_append(forward.forward(work), running, eos_ids)
            stats.num_decode_steps += 1
            if on_step:
                on_step(running)
        stats.decode_s = time.perf_counter() - start
        stats.num_generated_tokens = sum(len(s.output_token_ids) for s in sequences)
        for seq in sequences:
            blocks.free(seq.seq_id)
        return sequences

    def _sample_and_append(self, logits: torch.Tensor, sequences: list[Sequence], eos_ids: set[int]) -> None:
        result = sample_next_tokens(
            logits, [s.params for s in sequences], [s.seed for s in sequences], [s.num_tokens for s in sequences],
            [context_for(s, eos_ids) for s in sequences],
        )
        for seq, token_id, finite in zip(sequences, result.token_ids, result.finite):
            if not finite:
                seq.finish_reason = FinishReason.ERROR
                continue
            seq.output_token_ids.append(token_id)
            reason = stop_reason(token_id, len(seq.output_token_ids), seq.params, eos_ids)
            if reason is None and seq.num_tokens >= self.loaded.max_context_tokens:
                reason = FinishReason.LENGTH
            seq.finish_reason = reason
