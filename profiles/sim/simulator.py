"""The event loop: requests arrive, engines iterate, the router admits and migrates.

Each engine is a real `Scheduler` whose plans are "run" by a fake runner (deterministic
tokens, never EOS, so a request ends at its max_tokens) and whose iteration takes the cost
model's predicted time. New requests go through the real `admit`; every
`planner_interval_ms` the real `plan_migrations` runs on the views the router builds.
How the engines share the GPU is profiles/sim/device.py; the policies:

- **dualpace**: the CPU engine runs on its own clock. Per iteration cpu_service's own
  ModeChooser picks Local, Assisted or Cooperative from the latencies it has seen
  (profiles/sim/cpu_steps.py); Local iterations do not touch the device. With hold
  "cooperative" (the default: gpu_service on the same host) a Cooperative iteration's decode
  rows join the GPU engine's next step when it begins within one GPU layer
  (profiles/sim/cooperative.py), else it runs staged; a staged (Assisted) iteration's dense
  work goes to the device stage by stage, interleaved with the GPU engine's layers, its waits
  charged to the device budget gpu_service gives it (refused and redone locally past it). Hold
  "layer" (no joins: gpu_service on another host) runs staged iterations only.
- **gated**: with hold "cooperative", NEO as built: every CPU decode iteration's rows ride in
  the GPU engine's next step, so CPU-resident requests advance only inside GPU steps and the
  device is never held apart. With hold "layer" (gpu_service cannot join: it holds the device
  instead) a CPU iteration starts only at a GPU iteration boundary (or while the GPU engine is
  idle), is always Assisted and holds the device for the whole iteration, so the engines take
  turns.
- **gpu-only** (vLLM-like): no CPU engine; admission counts the KV allocated now plus a
  watermark (GpuAdmission.OPTIMISTIC, as vLLM V1), and the GPU scheduler preempts its newest
  request by recompute when a decode needs a block (`--gpu-admission reserve`: the old rule,
  every placed request at prompt + max_tokens, which never preempts).
- **hand-off and migrations** (profiles/sim/moves.py): paused at the source's step boundary
  (under dualpace a hand-off already in the apply of the step that sampled its first token, the
  hold gpu_service makes for the relay's `hold_after_first_token`, holds_for_handoff), reserved on the target, the KV over one PCIe link (transfers queue on it), committed on
  the target, released by the source. A request placed on the CPU is prefilled on the GPU
  when the GPU could ever hold it (handoff_source, as the relay decides), else on the CPU;
  until its first token it counts on the GPU, not migrating, as the relay starts its move then.

Commands that touch a scheduler (pause, commit) run only at that engine's step boundary,
as the real engine loop does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dualpace.engine.request import EngineRequest
from dualpace.engine.scheduler import Scheduler, StepPlan, StepResult
from dualpace.policy.host_tier import continue_on_host_tier
from dualpace.errors import InvalidArgument, Overloaded
from dualpace.policy.admission import AdmissionConfig, Placement, admit, handoff_source
from dualpace.policy.migration_planner import MigrationConfig, plan_migrations
from dualpace.policy.policies import traits
from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.sampling_params import SamplingParams
from profiles.sim.config import (
    CPU,
    GPU,
    SimConfig,
    SimulationError,
    deterministic_token,
)
from profiles.sim.cooperative import Cooperative
from profiles.sim.cpu_steps import CpuSteps, make_chooser
from profiles.sim.device import SharedDevice
from profiles.sim.moves import Moves
from profiles.sim.prefix import SimPrefixIndex, make_scheduler
from profiles.sim.router_views import RouterViews
from toolkit.workload import RequestSpec

MAX_IDLE_PLANNER_TICKS = 10_000  # planner ticks in a row with nothing else happening: stalled


@dataclass
class SimEngine:
    name: str
    kind: str
    scheduler: Scheduler
    busy: bool = False
    plan: StepPlan | None = None
    started_ms: float = 0.0
    done_version: int = 0  # the GPU engine's end moves when assist stages go inside its iteration
    commands: list[Callable[[], None]] = field(default_factory=list)
    num_iterations: int = 0
    num_local: int = 0
    num_assisted: int = 0
    busy_ms: float = 0.0
    staged_batch: int | None = None  # a staged Assisted iteration in flight: its batch size


@dataclass
class Track:
    """One request as the simulated router sees it."""

    spec: RequestSpec
    request_id: str
    engine: str = ""
    token_times_ms: list[float] = field(default_factory=list)
    finish_ms: float | None = None
    handoff_to: str | None = None  # placed on the CPU: prefilled on the GPU, then moved
    migrating: bool = False
    num_moves: int = 0  # committed moves, the hand-off included (the planner caps them)
    engines_seen: list[str] = field(default_factory=list)


class Simulator(CpuSteps, Cooperative, Moves, RouterViews):
    def __init__(self, cost: CostModel, config: SimConfig):
        self.cost = cost
        self.config = config
        profile = cost.profile
        self.vocab_size = profile.model.vocab_size
        self.block_size = profile.model.block_size
        self.num_layers = profile.model.num_layers
        gpu_blocks = config.gpu_kv_blocks if config.gpu_kv_blocks is not None else profile.capacities.gpu_kv_blocks
        cpu_blocks = config.cpu_kv_blocks if config.cpu_kv_blocks is not None else profile.capacities.cpu_kv_blocks
        caching, max_context = config.prefix_caching, config.max_context_tokens
        self.engines: dict[str, SimEngine] = {GPU: SimEngine(GPU, "gpu", make_scheduler(
            config.gpu_scheduler, gpu_blocks, self.block_size, max_context, "gpu", caching))}
        if traits(config.policy).uses_cpu_engine:
            self.engines[CPU] = SimEngine(CPU, "cpu", make_scheduler(
                config.cpu_scheduler, cpu_blocks, self.block_size, max_context, "cpu", caching))
        self.prefix = SimPrefixIndex({name: engine.scheduler for name, engine in self.engines.items()})
        self.chooser = make_chooser(cost, config.policy, config.cpu_scheduler.max_running,
                                    cooperative=config.assist_device_hold == "cooperative")
        # The profile's cost model drives admission and migration as the router's --profile does.
        self.admission = AdmissionConfig(config.policy, itl_target_ms=config.itl_target_ms, max_queue=config.max_queue,
                                         cpu_max_running=config.cpu_scheduler.max_running, predictor=cost,
                                         gpu_admission=config.gpu_admission)
        self.migration = MigrationConfig(
            predictor=cost,
            cpu_itl_target_ms=config.itl_target_ms,
            kv_transfer_bytes_per_s=profile.kv_transfer.bytes_per_s,
            kv_transfer_fixed_ms=profile.kv_transfer.fixed_ms,
            migration_overhead_ms=config.migration_overhead_ms,
            kv_bytes_per_token=profile.model.kv_bytes_per_token,
            cpu_max_running=config.cpu_scheduler.max_running,
        )
        self._first_context = profile.table2d("gpu_decode_ms").grid1[0]
        self.device = SharedDevice(self.num_layers)
        self.now_ms = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.link_free_at_ms = 0.0
        self._wake_at: set[float] = set()
        self.tracks: dict[str, Track] = {}
        self.index_of: dict[str, int] = {}
        self.queue: list[str] = []  # the router's wait queue
        self.num_rejected = 0
        self.num_handoffs = 0
        self.num_staged_refusals = 0  # staged Assisted iterations refused mid-way (their device wait ran out)
        self.num_gpu_engine_tokens = 0  # tokens the GPU engine's own iterations emitted (the rest: the CPU engine's)
        self.num_migrations = 0
        self.num_moves_without_kv = 0
        self._planner_armed = False
        self._idle_ticks = 0
        self._snapshots: dict[str, tuple[float | None, tuple[int, int, int] | None]] = {}

    # ------------------------------------------------------------------ events

    def _push(self, at_ms: float, kind: str, payload=None) -> None:
        heapq.heappush(self._events, (at_ms, next(self._seq), kind, payload))

    def run(self, specs: Sequence[RequestSpec]) -> list[Track]:
        for spec in specs:
            rid = f"req-{spec.index}"
            self.tracks[rid] = Track(spec, rid)
            self.index_of[rid] = spec.index
            self._push(spec.arrival_s * 1000.0, "arrival", rid)
        while self._events:
            at_ms, _, kind, payload = heapq.heappop(self._events)
            self.now_ms = at_ms
            self._idle_ticks = self._idle_ticks + 1 if kind == "plan" else 0
            if self._idle_ticks > MAX_IDLE_PLANNER_TICKS:
                break
            if kind == "arrival":
                self.queue.append(payload)
            elif kind == "done":
                name, version = payload
                engine = self.engines[name]
                if version != engine.done_version:
                    continue  # this end moved later (assist stages went inside the iteration)
                self._iteration_done(engine)
            elif kind == "call":
                payload()
            elif kind == "plan":
                self._planner_armed = False
                self._plan_tick()
            elif kind == "wake":
                self._wake_at.discard(at_ms)
            self._dispatch()
        unfinished = [t.request_id for t in self.tracks.values() if t.finish_ms is None]
        if unfinished:
            raise SimulationError(f"simulation stalled with {len(unfinished)} unfinished requests "
                                  f"(first: {unfinished[0]}); check the profile's capacities")
        return list(self.tracks.values())

    def _wake(self, at_ms: float) -> None:
        if at_ms not in self._wake_at:
            self._wake_at.add(at_ms)
            self._push(at_ms, "wake")

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        self._admit_queued()
        gpu = self.engines[GPU]
        cpu = self.engines.get(CPU)
        if cpu is not None and traits(self.config.policy).cpu_decodes_inside_gpu_steps:
            # the gate: the CPU goes at a GPU boundary, then the GPU; they take turns
            if self.device.last_user != "cpu" or not gpu.scheduler.has_work:
                self._try_start_cpu(cpu)
            self._try_start_gpu(gpu)
            self._try_start_cpu(cpu)
        else:
            self._try_start_gpu(gpu)
            if cpu is not None:
                self._try_start_cpu(cpu)
        if (traits(self.config.policy).migrates and not self._planner_armed
                and any(t.finish_ms is None and t.engine for t in self.tracks.values())):
            self._planner_armed = True
            self._push(self.now_ms + self.config.planner_interval_ms, "plan")

    def _admit_queued(self) -> None:
        while self.queue:
            rid = self.queue[0]
            track = self.tracks[rid]
            views = self._views(track.spec.input_len + 1)
            cached = self.prefix.cached_prefix_tokens(track.spec.prompt_token_ids)
            host = continue_on_host_tier(track.spec.input_len, track.spec.output_len, views, self._routed(),
                                         self.admission, cached, self.config.host_tier)
            placement, name = (Placement.CPU, host) if host else admit(
                track.spec.input_len, track.spec.output_len, views, self._routed(), len(self.queue) - 1,
                self.admission, cached)
            if placement is Placement.WAIT:
                # the router looks again when the next snapshot arrives (and on any other event)
                next_snapshot = [taken + self.config.view_interval_ms for taken, _ in self._snapshots.values()
                                 if taken is not None and taken + self.config.view_interval_ms > self.now_ms]
                if next_snapshot:
                    self._wake(min(next_snapshot))
                return
            self.queue.pop(0)
            if placement is Placement.REJECT:
                track.finish_ms = self.now_ms
                self.num_rejected += 1
                continue
            request = EngineRequest(rid, list(track.spec.prompt_token_ids),
                                    SamplingParams(max_tokens=track.spec.output_len, ignore_eos=True),
                                    seed=track.spec.index)
            first = name
            if placement is Placement.CPU and host is None:  # prefilled on a GPU engine that could hold it
                source = handoff_source(track.spec.input_len, track.spec.output_len, [views[GPU]])
                if source is not None:
                    first, track.handoff_to = source, name
                    request.hold_after_first_token = traits(self.config.policy).holds_for_handoff  # as the relay asks
            try:
                self.engines[first].scheduler.add(request)
            except (InvalidArgument, Overloaded):
                track.finish_ms = self.now_ms
                self.num_rejected += 1
                track.handoff_to = None
                continue
            track.engine = first
            track.engines_seen.append(first)

    @staticmethod
    def _plan_shape(plan: StepPlan) -> tuple[int, list[int], int]:
        """(prefill tokens, decode contexts, sequences sampled) of a plan."""
        prefill_tokens, contexts, sampled = 0, [], 0
        for seq in plan.sequences:
            sampled += seq.sample
            if len(seq.token_ids) == 1 and seq.start_pos > 0 and seq.sample:
                contexts.append(seq.start_pos + 1)
            else:
                prefill_tokens += len(seq.token_ids)
        return prefill_tokens, contexts, sampled

    def _try_start_gpu(self, gpu: SimEngine) -> None:
        if gpu.busy:
            return
        if not gpu.scheduler.has_work:
            if self.pending_join is not None:  # cooperative: nothing to join, the CPU's rows go alone
                self._run_join_alone()
            return
        if self.device.wait_ms(self.now_ms) > 0:
            self._wake(self.device.free_at_ms())
            return
        plan = gpu.scheduler.schedule()
        if plan.is_empty:
            if self.pending_join is not None:
                self._run_join_alone()
            return
        prefill_tokens, contexts, _ = self._plan_shape(plan)
        duration = self.cost.gpu_iteration_ms(prefill_tokens, DecodeBatch.of(contexts))
        if self.pending_join is not None:
            return self._start_with_join(gpu, plan, duration, prefill_tokens, contexts)
        end_ms = self.device.start_engine(self.now_ms, duration)
        self._start(gpu, plan, end_ms + self.config.engine_overhead_ms)

    def _assist_device_ms(self, batch: int) -> float:
        """The device time of an assisted batch's dense work: the GPU decode table at its
        smallest context (dense work and a negligible attention), at most assist_ms; the rest
        of assist_ms (round trips, PCIe payload) runs with the device free."""
        return min(self.cost.assist_ms(batch), self.cost.gpu_decode_ms(batch, self._first_context))

    def _start(self, engine: SimEngine, plan: StepPlan, end_ms: float) -> None:
        engine.busy = True
        engine.plan = plan
        engine.started_ms = self.now_ms
        engine.num_iterations += 1
        engine.done_version += 1
        self._push(end_ms, "done", (engine.name, engine.done_version))

    def _iteration_done(self, engine: SimEngine) -> None:
        if engine.kind == "gpu":
            self.device.engine_finished()
        else:
            self._staged_done(engine)
        plan = engine.plan
        sampled = {seq.request_id: deterministic_token(self.index_of[seq.request_id], seq.sample_position,
                                                       self.vocab_size)
                   for seq in plan.sequences if seq.sample}
        events = engine.scheduler.apply(plan, StepResult(sampled))
        engine.busy = False
        engine.plan = None
        engine.busy_ms += self.now_ms - engine.started_ms
        for event in events:
            track = self.tracks[event.request_id]
            if engine.kind == "gpu":
                self.num_gpu_engine_tokens += len(event.new_token_ids)
            for _ in event.new_token_ids:
                track.token_times_ms.append(self.now_ms)
            if event.finish_reason is not None:
                track.finish_ms = self.now_ms
                continue
            if track.handoff_to is not None and track.token_times_ms and not track.migrating:
                target = track.handoff_to
                self._move(track, engine, self.engines[target], handoff=True)
            elif event.held:  # no hand-off follows after all (another move is under way): it decodes here
                engine.scheduler.release_hold(event.request_id)
        self._run_commands(engine)

    def _run_commands(self, engine: SimEngine) -> None:
        commands, engine.commands = engine.commands, []
        for command in commands:
            command()

    def _at_boundary(self, engine: SimEngine, command: Callable[[], None]) -> None:
        if engine.busy:
            engine.commands.append(command)
        else:
            command()

    def _plan_tick(self) -> None:
        views = self._views()
        for move in plan_migrations(self._routed(), views, self.config.policy, self.migration):
            track = self.tracks[move.request_id]
            if track.migrating or track.finish_ms is not None:
                continue
            self._move(track, self.engines[move.source], self.engines[move.target])
