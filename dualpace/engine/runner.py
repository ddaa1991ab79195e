"""Executes a StepPlan on a device: one paged forward pass, then sampling.

Non-finite logits are always caught: sampling checks every sampled row with one
vectorised `isfinite` over the batch, and a row with NaN or Inf comes back as
None in the StepResult, so the scheduler ends that request alone (with
FinishReason.ERROR and a message) while the rest of the batch proceeds.
"""

from __future__ import annotations

import logging
import time

import torch

from dualpace.engine.assist.join_desk import JoinDesk, JoinRequest
from dualpace.engine.assist.joined_step import JoinedStep, JoinSettings
from dualpace.engine.scheduler import StepPlan, StepResult
from dualpace.engine.step_sampling import sample_step, step_work
from dualpace.errors import Unavailable
from dualpace.faults import FaultConfig
from dualpace.guided_decoding import GuidedMasks, GuidedRow
from dualpace.kv.storage import KVStorage
from dualpace.model.device_sync import work_finisher
from dualpace.model.loader import LoadedModel
from dualpace.model.decode_buckets import table_width_blocks
from dualpace.model.host_copies import HostCopies
from dualpace.model.paged_forward import PagedForward
from dualpace.model.static_decode import DecodeGraphs

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the device KV storage and runs the model over it."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_memory=None,
                 decode_graph_batch: int = 0, num_window_blocks: int = 0):
        """decode_graph_batch > 0: decode-only steps of up to that many sequences run through static
        buffers (dualpace.model.static_decode), replayed as CUDA graphs once capture_decode_graphs ran;
        the pool then has one block more than `num_blocks`, a scratch block no sequence is given.
        num_window_blocks > 0: the sliding layers of a model that also has global layers hold a pool of
        their own of that many blocks (dualpace.engine.core.kv_pool_sizes; with static buffers, one
        more, its scratch block); such a pool is not shared memory."""
        cfg = loaded.config
        model = loaded.model
        self.loaded = loaded
        if num_window_blocks:
            kv_memory = None
        num_scratch = 1 if decode_graph_batch else 0
        self.kv = KVStorage(cfg.num_layers, num_blocks + num_scratch, block_size, cfg.num_kv_heads, cfg.head_dim,
                            model.dtype, model.device, memory=kv_memory, window_layers=cfg.window_layers,
                            num_window_blocks=num_window_blocks + num_scratch if num_window_blocks else 0)
        self.forward = PagedForward(model, self.kv)
        self.host_copies = HostCopies(model.device)  # KV export/import: pinned, async on CUDA
        self.decode_graphs = None
        if decode_graph_batch:
            width = table_width_blocks(loaded.max_context_tokens, block_size, num_blocks)
            self.decode_graphs = DecodeGraphs(self.forward, decode_graph_batch, width, scratch_block=num_blocks,
                                              window_scratch_block=num_window_blocks or None)
        self.finish_device_work = work_finisher(model.device)  # steps end when their work has run
        self.faults = FaultConfig()  # test-only faults (dualpace.faults); the daemon sets them after warm-up
        self.num_forward_steps = 0  # non-empty plans executed since the faults were set
        self._guided: GuidedMasks | None = None  # structured outputs: see prepare_guided_decoding
        self.desk: JoinDesk | None = None  # remote rows offered to this engine's steps (set_join_desk)
        self._joined: JoinedStep | None = None
        self._step_joins: list[JoinRequest] = []  # taken by the running step, for run_plan
        self.max_join_rows = 256  # remote rows one step takes at most
        self.num_executed_steps = 0  # steps that ran (own rows or joins): the joins' engine_step_id
        self.last_step_record_fields: dict = {}  # the last step's joins, for its StepRecord (EngineLoop)

    def set_join_desk(self, desk: JoinDesk | None, settings: JoinSettings | None = None) -> None:
        """Let assist sessions' rows join this engine's steps;
        None: steps run their own rows only, as without a desk."""
        self.desk = desk
        self._joined = None if desk is None else JoinedStep(self.loaded.model, self.kv, desk,
                                                            settings or JoinSettings())

    def set_faults(self, faults: FaultConfig) -> None:
        """Honour `faults` from now on; forward steps are counted from here (1-based)."""
        self.faults = faults
        self.num_forward_steps = 0

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Raises when the forward pass fails: the engine cannot continue (every join
        the step took is failed with Unavailable first, so no CPU iteration waits for it)."""
        if self.desk is None:
            if plan.is_empty:
                return StepResult({})
            self.num_executed_steps += 1
            self.num_forward_steps += 1
            self.faults.check_forward(self.num_forward_steps)
            return self.run_plan(plan)
        self.last_step_record_fields = {}
        self._step_joins = self.desk.take(self.max_join_rows)
        try:
            if plan.is_empty and not self._step_joins:
                return StepResult({})
            self.num_executed_steps += 1
            if not plan.is_empty:
                self.num_forward_steps += 1
                self.faults.check_forward(self.num_forward_steps)
            return self.run_plan(plan)
        except BaseException as exc:
            self.desk.fail_taken(Unavailable(f"the GPU engine's step failed: {exc}"))
            raise
        finally:
            self._step_joins = []
            self.desk.end_step()

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> StepResult:
        """The forward pass and sampling of a non-empty plan, here (subclasses may run it elsewhere)."""
        sampled = [s for s in plan.sequences if s.sample]
        masks = self._start_guided_masks(sampled)  # computed while the forward pass runs
        work = step_work(plan)
        logits = self._forward(work)
        if not sampled:  # nothing read back: wait for the queued work, so it counts in this step's time
            self.finish_device_work()
        guided = None
        if masks is not None:
            guided_rows, future = masks
            guided = (guided_rows, future.result())
        # --fault-nan-logits-request: the target's row becomes NaN whenever it is sampled.
        return sample_step(plan, logits, self.faults.nan_logits_request, guided)

    def _forward(self, work) -> torch.Tensor:
        """The own rows' logits: with joins taken, the split step (no CUDA graphs: the remote
        attention sits between a layer's kernels); else a replayed decode graph or the plain pass."""
        joins = self._step_joins
        if joins:
            layout = self._joined.layout(work, joins)
            if layout.how.value != "staged":
                self._joined.split.between_layers = self.forward.between_layers  # staged sessions keep their turn
                logits = self._joined.run(work, joins, layout, self.num_executed_steps)
                self.last_step_record_fields = self._joined.last_record_fields
                return logits
            self._joined.decline(joins)  # staged stages lengthen the step less: the sessions run them
            if not work:
                return torch.empty((0, self.loaded.config.vocab_size))
        start = time.perf_counter()
        logits = self.decode_graphs.run(work) if self.decode_graphs is not None else None
        if logits is None:  # not a decode-only step that fits a bucket (or no static buffers)
            hook = self.forward.between_layers
            if self._joined is not None and hook is not None:  # the desk learns how far the step is
                self.forward.between_layers = self._joined.progress_hook(hook)
            try:
                logits = self.forward.forward(work)
            finally:
                self.forward.between_layers = hook
        if self._joined is not None:
            self._joined.record_plain_step(sum(len(w.token_ids) for w in work), (time.perf_counter() - start) * 1e3)
        return logits

    def capture_decode_graphs(self) -> None:
        """Capture the decode steps' CUDA graphs (at start-up); nothing to do off CUDA or without buffers."""
        if self.decode_graphs is None or self.kv.device.type != "cuda":
            return
        if self.forward.model.config.moe is not None:  # the experts a step runs depend on its rows
            log.info("mixture-of-experts model: decode steps run eagerly, without CUDA graphs")
            self.decode_graphs = None
            return
        try:
            self.decode_graphs.capture()
        except RuntimeError as exc:  # e.g. an op that cannot be captured: serve eagerly rather than not at all
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
            self.decode_graphs = None

    def prepare_guided_decoding(self) -> GuidedMasks:
        """The token masks of constrained requests; made on first use, or at start-up (the daemon's
        warm-up) so that the grammar engine's view of the vocabulary is built in the background."""
        if self._guided is None:
            tokenizer = self.loaded.tokenizer
            self._guided = GuidedMasks(tokenizer, set(self.loaded.config.eos_token_ids) | set(tokenizer.eos_token_ids))
        return self._guided

    def _start_guided_masks(self, sampled):
        """(rows of `sampled` under a constraint, the future of their token masks), or None."""
        guided_rows = [i for i, s in enumerate(sampled) if s.params.guided is not None]
        if not guided_rows:
            return None
        rows = [GuidedRow(s.request_id, s.params.guided, s.guided_token_ids, s.params.stop_token_ids)
                for s in (sampled[i] for i in guided_rows)]
        return guided_rows, self.prepare_guided_decoding().start(rows, self.loaded.config.vocab_size)

    # KV transfer: a request's cache as contiguous per-layer tensors, and back.

    def read_kv(self, slot_ids: list[int], layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_tokens, kv_heads, head_dim] of the given flat slots, on the CPU (pinned on CUDA)."""
        index = torch.tensor(slot_ids, dtype=torch.long, pin_memory=self.host_copies.staged)
        flat_shape = (-1, self.kv.num_kv_heads, self.kv.head_dim)
        k, v = self.host_copies.gather_to_host(
            [self.kv.k[layer_index].view(flat_shape), self.kv.v[layer_index].view(flat_shape)], index)
        return k, v

    def write_kv(self, slot_ids: list[int], layer_index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        index = torch.tensor(slot_ids, dtype=torch.long, device=self.kv.device)
        k, v = self.host_copies.to_device([k, v], self.kv.dtype)
        self.kv.write(layer_index, index, k, v)
