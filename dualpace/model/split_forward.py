"""A GPU engine step that carries remote rows: an assisted CPU iteration's decode rows, whose KV
and attention live on the CPU.

The step runs two sub-batches layer by layer:
- S1 = some own decode rows D1, then the remote rows R (last): one set of dense GEMMs over both;
- S0 = the rest (prefill chunks, other decodes): a full layer on this device.

Per layer: pre(S1); write D1's K/V; send R's q/k/v to their channels; S0's layer; attend(D1);
wait for R's attention (each join at most its bound); post(S1). The CPU attends while this
device runs S0's layer and D1's attention, so neither waits on the other beyond a layer. A join
whose attention does not come in time is sliced out of S1 (R's rows are last, so own row indices
never move) and its channel is failed with Overloaded; the other rows are untouched (every op
is per row or per sequence). After the last layer one `logits()` call covers every row left.

Eager on every device; no CUDA graphs (the remote attention sits between a layer's kernels).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dualpace.engine.assist.join_desk import RemoteRowsChannel
from dualpace.errors import Overloaded
from dualpace.kv.storage import KVStorage
from dualpace.model.paged_forward import StepTensors, attend
from dualpace.model.rope import HalfAngles
from dualpace.model.transformer import LayerKindAngles, Transformer


@dataclass
class RemoteRows:
    """One join's rows in the step: how many, its channel, and the longest wait per layer."""

    channel: RemoteRowsChannel
    token_ids: list[int]
    positions: list[int]
    wait_bound_s: float
    gpu_wait_s: float = 0.0  # how long the step blocked on this join's attention, over all layers
    dropped_at_layer: int | None = None
    error: BaseException | None = None  # with dropped_at_layer: what the channel was failed with

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)


@dataclass
class RemoteBatch:
    """The step's joins, in row order (their rows follow S1's own rows)."""

    joins: list[RemoteRows]

    def __post_init__(self):
        for join in self.joins:
            if join.num_rows == 0 or len(join.positions) != join.num_rows:
                raise ValueError("a join needs one position per token and at least one row")
            if join.wait_bound_s <= 0:
                raise ValueError(f"a join's wait bound must be positive, got {join.wait_bound_s}")

    @property
    def num_rows(self) -> int:
        return sum(j.num_rows for j in self.joins)


@dataclass
class SplitOutput:
    """own_logits: S0's logit rows, then S1's own; finished: (join, its float32 logits rows) for
    every join that lasted; dropped: the joins sliced out (their channels already failed)."""

    own_logits: torch.Tensor
    finished: list[tuple[RemoteRows, torch.Tensor]] = field(default_factory=list)
    dropped: list[RemoteRows] = field(default_factory=list)


def rope_rows(rope, index: torch.Tensor):
    """The rows `index` of a step's RoPE angles (HalfAngles, a (cos, sin) pair, or LayerKindAngles of those)."""
    if isinstance(rope, LayerKindAngles):
        return LayerKindAngles(rope_rows(rope.full, index), rope_rows(rope.local, index))
    if isinstance(rope, HalfAngles):
        return HalfAngles(rope.cos[index], rope.sin[index])
    return tuple(t[index] for t in rope)


class SplitForward:
    """Runs a Transformer step with remote rows over paged KV on the model's device."""

    def __init__(self, model: Transformer):
        self.model = model
        self.scale = model.config.attention_scale
        self.between_layers: Callable[[], None] | None = None  # as PagedForward's: staged sessions' turn
        self.layer_done: Callable[[int, float], None] | None = None  # (layer, layer_ms): JoinDesk.step_progress
        self.clock: Callable[[], float] = time.monotonic  # the channels' deadlines are on this clock
        # The last run's time in the work that covers the CPU's attention (S0's layers, D1's attention),
        # summed over layers, for step timelines; host time (on CUDA: the launches, not the kernels).
        self.last_cover_s = 0.0

    @torch.inference_mode()
    def run(self, s0: StepTensors | None, s1_own: StepTensors | None, remote: RemoteBatch,
            kv: KVStorage) -> SplitOutput:
        model = self.model
        device = model.device
        num_own = 0 if s1_own is None else int(s1_own.token_ids.shape[0])
        if s1_own is not None and s1_own.prefills:
            raise ValueError("S1's own rows must be decodes (one token each)")
        remote_ids = torch.tensor([t for j in remote.joins for t in j.token_ids], dtype=torch.long, device=device)
        remote_pos = torch.tensor([p for j in remote.joins for p in j.positions], dtype=torch.long, device=device)
        s1_ids = remote_ids if s1_own is None else torch.cat((s1_own.token_ids, remote_ids))
        s1_pos = remote_pos if s1_own is None else torch.cat((s1_own.positions, remote_pos))
        hidden1 = model.embed(s1_ids)
        rope1 = model.rope_angles(s1_pos)
        hidden0 = rope0 = None
        if s0 is not None:
            hidden0 = model.embed(s0.token_ids)
            rope0 = model.rope_angles(s0.positions)
        live = list(remote.joins)
        dropped: list[RemoteRows] = []
        layer_start = self.clock()
        self.last_cover_s = 0.0
        for layer in range(model.config.num_layers):
            if layer > 0:
                if self.layer_done is not None:
                    now = self.clock()
                    self.layer_done(layer - 1, (now - layer_start) * 1e3)
                    layer_start = now
                if self.between_layers is not None:
                    self.between_layers()
            if hidden1.shape[0] == 0:  # every join dropped and no own rows in S1: S0 alone
                hidden0 = hidden0 if s0 is None else self._full_layer(layer, s0, hidden0, rope0, kv)
                continue
            q1, k1, v1 = model.pre_attention(layer, hidden1, rope1)
            window = model.config.layer_window(layer)
            if num_own:
                kv.write(layer, s1_own.for_layer(window).slot_ids, k1[:num_own], v1[:num_own])
            row = num_own
            for join in live:
                end = row + join.num_rows
                join.channel.send_qkv(layer, q1[row:end], k1[row:end], v1[row:end])
                row = end
            cover_start = self.clock()
            if s0 is not None:
                hidden0 = self._full_layer(layer, s0, hidden0, rope0, kv)
            attention1 = q1.new_empty((q1.shape[0], q1.shape[1] * q1.shape[2]))
            if num_own:
                attention1[:num_own] = attend(q1[:num_own], layer, s1_own.for_layer(window), kv, self.scale,
                                              (k1[:num_own], v1[:num_own]), window)
            self.last_cover_s += self.clock() - cover_start
            keep = self._receive(layer, live, attention1, num_own)
            if keep is not None:  # some join was dropped: its rows leave S1 for good
                dropped.extend(j for j in live if j.dropped_at_layer is not None)
                live = [j for j in live if j.dropped_at_layer is None]
                hidden1, attention1, rope1 = hidden1[keep], attention1[keep], rope_rows(rope1, keep)
            hidden1 = model.post_attention(layer, hidden1, attention1)
        return self._logits(s0, s1_own, hidden0, hidden1, num_own, live, dropped)

    def _full_layer(self, layer: int, s0: StepTensors, hidden0: torch.Tensor, rope0, kv: KVStorage) -> torch.Tensor:
        """S0's whole layer: pre, K/V written, attention, post."""
        model = self.model
        q0, k0, v0 = model.pre_attention(layer, hidden0, rope0)
        window = model.config.layer_window(layer)
        layer_step = s0.for_layer(window)
        kv.write(layer, layer_step.slot_ids, k0, v0)
        return model.post_attention(layer, hidden0, attend(q0, layer, layer_step, kv, self.scale, (k0, v0), window))

    def _receive(self, layer: int, live: list[RemoteRows], attention1: torch.Tensor,
                 num_own: int) -> torch.Tensor | None:
        """Each live join's attention of `layer` into its rows of attention1; the rows to keep when
        a join did not answer in time (it is marked dropped and its channel failed), else None."""
        row = num_own
        keep: list[int] | None = None
        for join in live:
            end = row + join.num_rows
            started = self.clock()
            out = join.channel.receive_attention(layer, started + join.wait_bound_s)
            join.gpu_wait_s += self.clock() - started
            if out is None or tuple(out.shape) != (join.num_rows, attention1.shape[1]):
                join.dropped_at_layer = layer
                why = "did not come in time" if out is None else f"has shape {tuple(out.shape)}"
                join.error = Overloaded(f"the attention of layer {layer} {why}; the rows were dropped "
                                        "from the GPU step, redo the iteration locally")
                join.channel.fail(join.error)
                if keep is None:
                    keep = list(range(row))
            else:
                attention1[row:end] = out.to(device=attention1.device, dtype=attention1.dtype)
                if keep is not None:
                    keep.extend(range(row, end))
            row = end
        if keep is None:
            return None
        return torch.tensor(keep + list(range(row, attention1.shape[0])), dtype=torch.long,
                            device=attention1.device)

    def _logits(self, s0, s1_own, hidden0, hidden1, num_own: int, live: list[RemoteRows],
                dropped: list[RemoteRows]) -> SplitOutput:
        """One LM-head call over S0's and S1's returned rows and every live join's rows."""
        parts = []
        if s0 is not None:
            parts.append(hidden0[s0.logit_token_index])
        if num_own:
            parts.append(hidden1[s1_own.logit_token_index])
        parts.append(hidden1[num_own:])
        rows = torch.cat(parts)
        if rows.shape[0] == 0:  # nothing left to read the LM head for
            return SplitOutput(rows.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), [], dropped)
        logits = self.model.logits(rows)
        num_remote = sum(j.num_rows for j in live)
        num_own_rows = logits.shape[0] - num_remote
        finished = []
        row = num_own_rows
        for join in live:
            finished.append((join, logits[row:row + join.num_rows]))
            row += join.num_rows
        return SplitOutput(logits[:num_own_rows], finished, dropped)
