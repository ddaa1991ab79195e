"""An assisted iteration: dense stages on gpu_service, attention here over host KV.

gpu_service takes its device only for each layer's dense stage, so the GPU engine keeps
running while this side computes attention (gated, held: the whole iteration holds the device).
A cooperative iteration (`join`) asks gpu_service to run the rows inside its engine's next step
instead; the exchange here is the same, and `expected_layer_us` (this side's measured attention
time per layer) goes with the ask, for the server's planner and its per-layer wait bound."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from cpu_service.assist_client import AssistClient
from cpu_service.assist_join import MAX_JOIN_WAIT_US, NO_JOIN, JoinAsk
from dualpace.engine.run_delay import runqueue_wait_ns
from dualpace.engine.scheduler import StepPlan, StepResult
from dualpace.engine.step_sampling import needs_logits_here, sample_step, step_work
from dualpace.kv.storage import KVStorage
from dualpace.model.config import ModelConfig
from dualpace.model.paged_forward import attend, build_step_tensors

LAYER_TIME_EMA_WEIGHT = 0.2  # weight of a new iteration's mean attention time per layer


class AssistedForward:
    def __init__(self, kv: KVStorage, config: ModelConfig, client: AssistClient, gated: bool = False):
        self.kv = kv
        self.config = config
        self.scale = config.attention_scale
        self.client = client
        self.gated = gated  # the NEO-like baseline: wait for the GPU engine's iteration boundary
        self.expected_layer_us = 0.0  # EMA of this side's attention time per layer (0: not measured yet)
        self.last_attention_ns = 0  # the last iteration's attention time here, all layers
        self.last_runqueue_delay_ns = 0  # the last iteration's time runnable without a core (run_delay.py)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, max_device_wait_ms: int = 0, join: JoinAsk = NO_JOIN) -> StepResult:
        """Run a decode-only plan (one token per sequence, each sampled). Raises
        AssistUnavailable if gpu_service fails; the caller then redoes the step locally
        (the K/V rows written so far sit in the same slots the redo rewrites)."""
        step = build_step_tensors(step_work(plan), self.kv.block_size, self.kv.device)
        attend_ns = [0, 0]  # total time in attend_here, number of layers

        def attend_here(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            started_ns = time.perf_counter_ns()
            window = self.config.layer_window(layer)
            layer_step = step.for_layer(window)
            self.kv.write(layer, layer_step.slot_ids, k, v)
            output = attend(q.to(self.kv.dtype), layer, layer_step, self.kv, self.scale, window=window).to(q.dtype)
            attend_ns[0] += time.perf_counter_ns() - started_ns
            attend_ns[1] += 1
            return output

        if join.join:
            join = replace(join, expected_layer_us=min(MAX_JOIN_WAIT_US, round(self.expected_layer_us)))
        # Penalties and log-probabilities need the requests' state, which lives here: then the GPU
        # returns the logits and this side samples them exactly as a local iteration would.
        sample_here = needs_logits_here(plan)
        runqueue_before_ns = runqueue_wait_ns()
        token_ids = self.client.run_iteration(
            [s.token_ids[0] for s in plan.sequences],
            [s.start_pos for s in plan.sequences],
            attend_here,
            None if sample_here else [(s.params, s.seed) for s in plan.sequences],
            wait_for_engine_iteration=self.gated,
            max_device_wait_ms=max_device_wait_ms,
            join=join,
        )
        self.last_attention_ns = attend_ns[0]
        self.last_runqueue_delay_ns = max(0, runqueue_wait_ns() - runqueue_before_ns)
        if attend_ns[1]:
            layer_us = attend_ns[0] / attend_ns[1] / 1e3
            previous = self.expected_layer_us
            self.expected_layer_us = layer_us if not previous else (
                (1 - LAYER_TIME_EMA_WEIGHT) * previous + LAYER_TIME_EMA_WEIGHT * layer_us)
        if sample_here:
            return sample_step(plan, token_ids)
        return StepResult({s.request_id: token_id for s, token_id in zip(plan.sequences, token_ids)})
