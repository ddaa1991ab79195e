"""One forward step over a mixed batch of prefill chunks and decode tokens, on paged KV.

The caller (an engine runner or the offline generator) decides which sequences
run and which blocks they own; this module turns that into tensors, runs the
model's stages layer by layer and returns logits. Dense stages run once over all
of the step's tokens. Attention on CUDA is one launch of the paged Triton kernel for every
sequence (dualpace.model.triton_attention, blocks read in place); elsewhere it runs batched
for the decode tokens and per sequence for prefill chunks (dualpace.model.attention).

`between_layers`, when set, is called after each layer but the last: gpu_service uses it
to hand the device to a waiting Dense Assist stage (DeviceHandoff.yield_to_waiting). With
it set, the one-call fused CPU decode path is not used (it would offer the device only at
the step's end), so every step runs layer by layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from dualpace.kv.block_table import FREED_BLOCK_ID, readable_block_ids
from dualpace.kv.storage import KVStorage
from dualpace.model import cpu_kernels
from dualpace.model.cpu_fused_decode import FusedDecode
from dualpace.model.attention import decode_attention, prefill_attention
from dualpace.model.attention_backend import uses_triton
from dualpace.model.triton_attention import VarlenBatch, paged_attention, supported
from dualpace.model.rope import HalfAngles
from dualpace.model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceWork:
    """One sequence's share of a step: new tokens starting at `start_pos`."""

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]  # the sequence's block table, covering start_pos + len(token_ids)
    all_logits: bool = False  # return logits for every new token, not just the last
    # The sliding layers' block table where they have a pool of their own (KVStorage.has_window_pool)
    window_block_ids: list[int] | None = None


@dataclass
class StepTensors:
    """The step's metadata, as tensors on the model's device."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_ids: torch.Tensor  # [T]
    decode_token_index: torch.Tensor  # [D] index into T of each decode token
    decode_block_tables: torch.Tensor  # [D, max_blocks]
    decode_context_lens: torch.Tensor  # [D]
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (first token index, num tokens, start_pos, block_ids)
    logit_token_index: torch.Tensor  # [N] rows of hidden whose logits are returned
    varlen: VarlenBatch | None = None  # every sequence at once, for the paged Triton kernel
    window_pool: StepTensors | None = None  # the same step over the sliding layers' own pool, if they have one

    def for_layer(self, window: int | None) -> StepTensors:
        """What a layer writes and reads (window: ModelConfig.layer_window): a sliding layer with a
        pool of its own gets the sliding pool's slots and tables, any other layer these."""
        return self.window_pool if window is not None and self.window_pool is not None else self


def build_step_tensors(work: list[SequenceWork], block_size: int, device: torch.device) -> StepTensors:
    """The step's tensors; with the sliding layers' tables (window_block_ids) given, the same again
    over those tables as `window_pool`."""
    with_window_pool = [seq.window_block_ids is not None for seq in work]
    if any(with_window_pool) and not all(with_window_pool):
        raise ValueError("either every sequence of a step names its sliding layers' table or none does")
    step = _step_tensors(work, block_size, device)
    if any(with_window_pool):
        step.window_pool = _step_tensors([replace(seq, block_ids=seq.window_block_ids, window_block_ids=None)
                                          for seq in work], block_size, device)
    return step


def _step_tensors(work: list[SequenceWork], block_size: int, device: torch.device) -> StepTensors:
    token_ids: list[int] = []
    positions: list[int] = []
    slot_ids: list[int] = []
    decode_index: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[tuple[int, int, int, list[int]]] = []
    logit_index: list[int] = []
    seq_tables: list[list[int]] = []
    for seq in work:
        first = len(token_ids)
        num_new = len(seq.token_ids)
        end_pos = seq.start_pos + num_new
        if num_new == 0:
            raise ValueError("a sequence in a step must have at least one new token")
        if len(seq.block_ids) * block_size < end_pos:
            raise ValueError(f"block table of {len(seq.block_ids)} blocks cannot hold {end_pos} tokens")
        token_ids.extend(seq.token_ids)
        table = readable_block_ids(seq.block_ids[: (end_pos + block_size - 1) // block_size])
        seq_tables.append(table)
        for pos in range(seq.start_pos, end_pos):
            positions.append(pos)
            block_id = seq.block_ids[pos // block_size]
            if block_id == FREED_BLOCK_ID:
                raise ValueError(f"position {pos} falls in a block the sliding window returned to the pool")
            slot_ids.append(block_id * block_size + pos % block_size)
        if num_new == 1:
            decode_index.append(first)
            decode_tables.append(table)
            decode_lens.append(end_pos)
        else:
            prefills.append((first, num_new, seq.start_pos, table))
        if seq.all_logits:
            logit_index.extend(range(first, first + num_new))
        else:
            logit_index.append(first + num_new - 1)
    max_blocks = max((len(t) for t in decode_tables), default=0)
    padded = [t + [t[0]] * (max_blocks - len(t)) for t in decode_tables]

    def as_tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    varlen = None
    if uses_triton(device):
        longest = max(len(t) for t in seq_tables)
        query_start = [0]
        for seq in work:
            query_start.append(query_start[-1] + len(seq.token_ids))
        varlen = VarlenBatch(
            query_start=as_tensor(query_start), start_pos=as_tensor([seq.start_pos for seq in work]),
            block_tables=as_tensor([t + [t[0]] * (longest - len(t)) for t in seq_tables]),
            max_new_tokens=max(len(seq.token_ids) for seq in work))
    return StepTensors(
        varlen=varlen,
        token_ids=as_tensor(token_ids),
        positions=as_tensor(positions),
        slot_ids=as_tensor(slot_ids),
        decode_token_index=as_tensor(decode_index),
        decode_block_tables=as_tensor(padded).view(len(padded), max_blocks),
        decode_context_lens=as_tensor(decode_lens),
        prefills=[(first, n, start, as_tensor(blocks)) for first, n, start, blocks in prefills],
        logit_token_index=as_tensor(logit_index),
    )


def attend(
    q: torch.Tensor, layer_index: int, step: StepTensors, kv: KVStorage, scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
) -> torch.Tensor:
    """Attention output [T, num_heads * head_dim] for all of a step's tokens (K/V already written;
    new_kv, the step's k and v [T, kv_heads, head_dim] as written, spares a prefill from position 0
    the gathered copy of its blocks; window: the layer's sliding window, ModelConfig.layer_window)."""
    k_cache, v_cache = kv.k[layer_index], kv.v[layer_index]
    if step.varlen is not None and window is None and supported(q, k_cache):  # one launch, blocks read in place
        return paged_attention(q, k_cache, v_cache, step.varlen, scale)
    num_tokens = q.shape[0]
    if not step.prefills:
        return decode_attention(q, k_cache, v_cache, step.decode_block_tables, step.decode_context_lens, scale,
                                window)

    def prefill(first: int, num_new: int, start_pos: int, block_ids: torch.Tensor) -> torch.Tensor:
        fresh = None if new_kv is None else (new_kv[0][first:first + num_new], new_kv[1][first:first + num_new])
        return prefill_attention(q[first:first + num_new], k_cache, v_cache, block_ids, start_pos, scale, fresh,
                                 window)

    if len(step.prefills) == 1 and step.prefills[0][1] == num_tokens:  # one prompt is the whole step
        return prefill(*step.prefills[0])
    out = q.new_empty((num_tokens, q.shape[1] * q.shape[2]))
    if step.decode_token_index.numel():
        out[step.decode_token_index] = decode_attention(
            q[step.decode_token_index], k_cache, v_cache, step.decode_block_tables, step.decode_context_lens, scale,
            window)
    for first, num_new, start_pos, block_ids in step.prefills:
        out[first : first + num_new] = prefill(first, num_new, start_pos, block_ids)
    return out


class PagedForward:
    """Runs a Transformer over paged KV storage on the same device."""

    def __init__(self, model: Transformer, kv: KVStorage):
        self.model = model
        self.kv = kv
        self.scale = model.config.attention_scale
        self._fused: FusedDecode | None = None
        self._fused_for: cpu_kernels.Kernels | None = None  # the kernels _fused was decided for
        self.between_layers: Callable[[], None] | None = None  # a yield point, called between layers

    def _fused_decode(self, step: StepTensors) -> FusedDecode | None:
        """The one-call-per-step CPU path, for decode-only steps of at most FusedDecode.max_rows tokens."""
        num_tokens = step.token_ids.shape[0]
        if step.prefills or num_tokens > cpu_kernels.MIXED_MAX_ROWS or num_tokens == 0:
            return None
        if step.window_pool is not None:  # the fused call reads one pool's slots and tables for every layer
            return None
        if self.between_layers is not None:  # the fused call has no point between layers to yield at
            return None
        kernels = cpu_kernels.get()
        if kernels is None:
            return None
        if self._fused_for is not kernels:  # checked once per kernels object, the answer kept
            self._fused_for = kernels
            applies = FusedDecode.applies(self.model, self.kv, kernels)
            missing = FusedDecode.missing_features(self.model.config)
            if missing:
                log.info("decode runs stage by stage on the CPU kernels: the one-call fused step lacks %s",
                         ", ".join(missing))
            self._fused = FusedDecode(kernels, self.model, self.kv) if applies else None
        if self._fused is None or num_tokens > self._fused.max_rows:
            return None
        return self._fused

    @torch.inference_mode()
    def forward(self, work: list[SequenceWork]) -> torch.Tensor:
        """Process the step; returns float32 logits, one row per returned token, in `work` order."""
        step = build_step_tensors(work, self.kv.block_size, self.model.device)
        return self.forward_tensors(step)

    @torch.inference_mode()
    def forward_tensors(self, step: StepTensors) -> torch.Tensor:
        model = self.model
        hidden = model.embed(step.token_ids)
        rope = model.rope_angles(step.positions)
        fused = self._fused_decode(step)
        if fused is not None and isinstance(rope, HalfAngles):
            args = (hidden, rope.cos, rope.sin, step.slot_ids, step.decode_block_tables, step.decode_context_lens)
            if fused.head_applies(hidden):  # a decode-only step returns every row's logits, in order
                return fused.run(*args, with_logits=True)
            fused.run(*args)
            return model.logits(hidden[step.logit_token_index], invariant=True)
        between_layers = self.between_layers
        # decode rows get the kernels' products even beside a prefill (batch invariance)
        decode_rows = step.decode_token_index if step.decode_token_index.numel() else None
        for layer_index in range(model.config.num_layers):
            if layer_index > 0 and between_layers is not None:
                between_layers()
            q, k, v = model.pre_attention(layer_index, hidden, rope, kernel_rows=decode_rows)
            window = model.config.layer_window(layer_index)
            layer_step = step.for_layer(window)
            self.kv.write(layer_index, layer_step.slot_ids, k, v)
            attention_out = attend(q, layer_index, layer_step, self.kv, self.scale, (k, v), window)
            hidden = model.post_attention(layer_index, hidden, attention_out, kernel_rows=decode_rows)
        return model.logits(hidden[step.logit_token_index], invariant=True)
