"""A GPU engine step that carries the joins the JoinDesk handed it: the layout from the pure planner
(dualpace.policy.cooperative_plan), the layer loop in dualpace.model.split_forward, then each join's
logits to its channel and its outcome to the desk.

The own rows' logits come back in the plan's order, so sampling is the same as a plain step's.
A join the planner declines (STAGED) is settled NOT_TAKEN before any of its rows ran: its
session then runs it staged. The policy follows the joins: a gated join (max_join_wait_us 0)
makes the step plan as gated (no GPU wait first), else dualpace (the shortest step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dualpace.engine.assist.join_desk import JoinDesk, JoinOutcome, JoinRequest, JoinStepInfo
from dualpace.engine.assist.ring_pacing import LayerMarks
from dualpace.engine.run_delay import runqueue_wait_ns
from dualpace.model.paged_forward import SequenceWork, build_step_tensors
from dualpace.model.split_forward import RemoteBatch, RemoteRows, SplitForward
from dualpace.model.transformer import Transformer
from dualpace.kv.storage import KVStorage
from dualpace.policy.cooperative_plan import (CooperativeLayout, JoinHow, LayerCosts, LayerTimes,
                                              OwnRows, RemoteJoin, join_wait_bound_ms, plan_layout)
from dualpace.policy.policies import Policy
from dualpace.profile.cost_model import layer_costs_measured

log = logging.getLogger(__name__)

DEFAULT_JOIN_MIN_LAYER_WAIT_MS = 50.0  # the least per-layer wait before a join is dropped (min_ms)


@dataclass
class JoinSettings:
    """min_layer_wait_ms: join_wait_bound_ms's floor (gpu_service --assist-join-min-layer-wait-ms);
    cost_seed: a profile's per-layer costs, used where the runner has measured nothing yet."""

    min_layer_wait_ms: float = DEFAULT_JOIN_MIN_LAYER_WAIT_MS
    cost_seed: LayerCosts | None = None


def fallback_layout(own: OwnRows) -> CooperativeLayout:
    """Without any costs: every own decode in S1 (one dense pass for them and the remote rows)."""
    num_decodes = len(own.decode_context_tokens)
    how = JoinHow.SPLIT if own.num_prefill_tokens else JoinHow.JOINED
    return CooperativeLayout(how, num_decodes, 0.0, 0.0)


def logit_rows(work: SequenceWork) -> int:
    return len(work.token_ids) if work.all_logits else 1


class JoinedStep:
    def __init__(self, model: Transformer, kv: KVStorage, desk: JoinDesk, settings: JoinSettings):
        self.model, self.kv, self.desk, self.settings = model, kv, desk, settings
        self.split = SplitForward(model)
        self.split.layer_done = desk.step_progress
        self.layer_times = LayerTimes()  # per-layer times of plain steps, the planner's measured costs
        self.last_record_fields: dict = {}  # the last joined step's StepRecord fields

    def record_plain_step(self, num_tokens: int, step_ms: float) -> None:
        """A step without joins: its time spread evenly over the layers, as dense time of its rows."""
        self.layer_times.record_dense(num_tokens, step_ms / self.model.config.num_layers)

    def progress_hook(self, between_layers: Callable[[], None]) -> Callable[[], None]:
        """`between_layers` that first tells the desk which layer of a plain step just finished."""
        layer, start = 0, time.perf_counter()

        def hook() -> None:
            nonlocal layer, start
            now = time.perf_counter()
            self.desk.step_progress(layer, (now - start) * 1e3)
            layer, start = layer + 1, now
            between_layers()

        return hook

    def layout(self, work: list[SequenceWork], joins: list[JoinRequest]) -> CooperativeLayout:
        decode_contexts = [w.start_pos + 1 for w in work if len(w.token_ids) == 1 and not w.all_logits]
        num_prefill_tokens = sum(len(w.token_ids) for w in work) - len(decode_contexts)
        own = OwnRows(num_prefill_tokens, decode_contexts)
        costs = layer_costs_measured(self.layer_times, self.settings.cost_seed)
        if costs is None:
            return fallback_layout(own)
        gated = any(int(getattr(j.begin, "max_join_wait_us", 0)) == 0 for j in joins)
        policy = Policy.GATED if gated else Policy.DUALPACE
        remote = [RemoteJoin(j.num_rows, int(getattr(j.begin, "expected_layer_us", 0)) / 1e3) for j in joins]
        return plan_layout(policy, own, remote, costs)

    def decline(self, joins: list[JoinRequest]) -> None:
        for join in joins:
            self.desk.settle(join, JoinOutcome.NOT_TAKEN)

    @torch.inference_mode()
    def run(self, work: list[SequenceWork], joins: list[JoinRequest], layout: CooperativeLayout,
            step_id: int) -> torch.Tensor:
        """Run the step with `joins` on board; returns the own rows' logits in `work` order (each
        join's rows went to its channel, and every join is settled with the desk)."""
        start_ns = time.monotonic_ns()
        decodes = [i for i, w in enumerate(work) if len(w.token_ids) == 1 and not w.all_logits]
        d1 = set(sorted(decodes, key=lambda i: -work[i].start_pos)[:layout.d1_rows])  # the longest contexts
        s0_index = [i for i in range(len(work)) if i not in d1]
        s1_index = sorted(d1)
        device = self.model.device
        s0 = build_step_tensors([work[i] for i in s0_index], self.kv.block_size, device) if s0_index else None
        s1 = build_step_tensors([work[i] for i in s1_index], self.kv.block_size, device) if s1_index else None
        remote = RemoteBatch([
            RemoteRows(j.channel, list(j.begin.token_ids), list(j.begin.positions),
                       join_wait_bound_ms(int(getattr(j.begin, "expected_layer_us", 0)),
                                          self.settings.min_layer_wait_ms) / 1e3)
            for j in joins])
        runqueue_before_ns = runqueue_wait_ns()
        out = self.split.run(s0, s1, remote, self.kv)
        runqueue_delay_ns = max(0, runqueue_wait_ns() - runqueue_before_ns)
        end_ns = time.monotonic_ns()
        for join, rows in zip(joins, remote.joins):
            if rows.dropped_at_layer is not None:
                self.desk.settle(join, JoinOutcome.DROPPED, rows.error)
        how = "split" if s0 is not None else "joined"
        self.last_record_fields = {
            "joins": [(str(getattr(j.channel, "peer", "")), int(getattr(j.begin, "iteration_id", 0)), j.num_rows)
                      for j in joins],  # (peer, iteration_id, rows)
            "how": how, "gpu_wait_ns": int(sum(r.gpu_wait_s for r in remote.joins) * 1e9),
            "cover_ns": int(self.split.last_cover_s * 1e9),
            "num_weight_passes": 2 if s0 is not None else 1, "runqueue_delay_ns": runqueue_delay_ns,
            **self._marks(joins)}
        for rows, logits in out.finished:
            join = joins[remote.joins.index(rows)]
            info = JoinStepInfo(step_id, how, int(rows.gpu_wait_s * 1e6), start_ns, end_ns)
            try:
                rows.channel.finish(logits, info)
            except Exception as exc:  # this join's peer is gone; the other rows are unaffected
                log.warning("sending a joined iteration's result failed: %s", exc)
                self.desk.settle(join, JoinOutcome.DROPPED, exc)
                continue
            self.desk.settle(join, JoinOutcome.TAKEN_DONE)
        return self._in_work_order(work, s0_index, s1_index, out.own_logits)

    @staticmethod
    def _marks(joins: list[JoinRequest]) -> dict:
        """Where the joins' per-layer round trips went (their channels' LayerMarks, summed)."""
        total = LayerMarks()
        for join in joins:
            marks = getattr(join.channel, "marks", None)
            if isinstance(marks, LayerMarks):
                total.merge(marks)
        return total.record_fields()

    @staticmethod
    def _in_work_order(work, s0_index, s1_index, own_logits: torch.Tensor) -> torch.Tensor:
        starts, row = {}, 0
        for i in s0_index + s1_index:
            starts[i] = row
            row += logit_rows(work[i])
        order = [starts[i] + r for i in range(len(work)) for r in range(logit_rows(work[i]))]
        if order == list(range(len(order))):
            return own_logits
        return own_logits[torch.tensor(order, dtype=torch.long, device=own_logits.device)]
