"""Discrete-event simulator: the real schedulers, admission and migration planner, with the
profile's cost model as the clock (ARCHITECTURE §5).

Nothing here re-implements a policy. Each engine is a real `Scheduler` (one per engine)
whose plans are "run" by a fake runner that returns deterministic tokens (never EOS, so a
request ends at its max_tokens), and whose iteration takes the cost model's predicted time.
New requests go through the real `admit`; every `planner_interval_ms` the real
`plan_migrations` runs on the same views the router builds. What the simulator adds is only
the passage of time:

- **device**: the GPU is one resource booked on a timeline. A GPU engine iteration holds it
  for its predicted time; an Assisted CPU iteration holds it from its start to its result
  (as the real Dense Assist session holds the device lock), so the two never overlap
  (`assist_device_hold="dense"` is a what-if: only the assist_ms part holds it).
- **dualpace**: the CPU engine runs on its own clock. Per iteration it compares Local
  (cpu_local_ms) with Assisted (the wait for the device + cpu_assisted_ms) and takes the
  faster; Local iterations do not touch the device.
- **gated** (NEO-like): a CPU iteration starts only at a GPU iteration boundary (or while
  the GPU engine is idle), is always Assisted, and the GPU engine and the CPU engine then
  take turns on the device, so a CPU-resident request advances at most once per GPU iteration.
- **gpu-only** (vLLM-like): no CPU engine; the GPU scheduler preempts by recompute.
- **hand-off and migrations**: at the source's next step boundary the request is paused
  (Scheduler.pause), blocks are reserved on the target (reserve_import), the KV crosses one
  PCIe link (transfers queue on it; kv_transfer_ms each), then the target commits
  (commit_import) and the source releases. A failed reservation resumes the request.

Commands that touch a scheduler (pause, commit) run only at that engine's step boundary,
as the real engine loop does. Pure: no clock reads, no torch, grpc or asyncio; the same
inputs give the same result.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from bench.load.lengths import RequestSpec
from bench.load.stats import percentile
from dualpace.engine.request import EngineRequest
from dualpace.engine.scheduler import Scheduler, SchedulerConfig, StepPlan, StepResult
from dualpace.errors import DualPaceError, InvalidArgument, Overloaded, RequestNotFound
from dualpace.sampling_params import SamplingParams
from profiles.cost_model import CostModel, DecodeBatch
from router.admission import AdmissionConfig, Placement, admit
from router.migration_planner import MigrationConfig, plan_migrations
from router.views import EngineView, Policy, RoutedRequest

GPU, CPU = "gpu0", "cpu0"
MAX_IDLE_PLANNER_TICKS = 10_000  # planner ticks in a row with nothing else happening: stalled


class SimulationError(DualPaceError):
    """The simulation cannot make progress (e.g. a request that fits no engine)."""


@dataclass(frozen=True)
class SimConfig:
    policy: Policy = Policy.DUALPACE
    gpu_scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(max_batch_tokens=2048, max_running=256, max_waiting=1 << 30))
    cpu_scheduler: SchedulerConfig = field(
        default_factory=lambda: SchedulerConfig(max_batch_tokens=512, max_running=128, max_waiting=1 << 30))
    planner_interval_ms: float = 100.0
    itl_target_ms: float | None = None  # admission: an engine whose predicted ITL (one more request) exceeds it takes none
    max_context_tokens: int = 1 << 20
    migration_overhead_ms: float = 10.0
    max_queue: int = 1 << 30  # the router's wait queue (a simulation should not reject by default)
    # How long an Assisted CPU iteration holds the GPU: "iteration" (from its start to its result,
    # as gpu_service's AssistSession holds the device lock today) or "dense" (only assist_ms: a
    # what-if where the GPU engine's iterations interleave with the CPU's attention).
    assist_device_hold: str = "iteration"
    # What-if: drop planned moves of requests that have no token yet (queued or preempted on the
    # GPU), so every prompt is prefilled on the GPU. Off: the planner's moves run as planned
    # (the CPU engine then recomputes those prompts locally).
    skip_unprefilled_moves: bool = False


def deterministic_token(request_index: int, position: int, vocab_size: int) -> int:
    """The fake runner's token: a function of the request and the position only (never EOS:
    the simulated engines have no EOS ids)."""
    return 1 + (request_index * 7919 + position * 104729) % max(1, vocab_size - 1)


@dataclass
class _Engine:
    name: str
    kind: str
    scheduler: Scheduler
    busy: bool = False
    plan: StepPlan | None = None
    commands: list[Callable[[], None]] = field(default_factory=list)
    num_iterations: int = 0
    num_local: int = 0
    num_assisted: int = 0
    busy_ms: float = 0.0


@dataclass
class _Track:
    spec: RequestSpec
    request_id: str
    engine: str = ""
    token_times_ms: list[float] = field(default_factory=list)
    finish_ms: float | None = None
    handoff_to: str | None = None  # placed on the CPU: prefilled on the GPU, then moved
    migrating: bool = False
    engines_seen: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SimResult:
    policy: str
    rate: float
    num_requests: int
    requests_completed: int
    requests_rejected: int
    duration_s: float
    throughput_tokens_per_s: float
    requests_per_s: float
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    p50_itl_ms: float | None
    p99_itl_ms: float | None
    mean_itl_ms: float | None
    num_generated_tokens: int
    num_handoffs: int
    num_migrations: int
    num_moves_without_kv: int
    num_preemptions: int
    gpu_iterations: int
    cpu_iterations: int
    cpu_local_iterations: int
    cpu_assisted_iterations: int
    requests_touching_cpu: int
    gpu_busy_fraction: float
    cpu_busy_fraction: float

    def as_dict(self) -> dict:
        out = {}
        for name, value in self.__dict__.items():
            out[name] = round(value, 3) if isinstance(value, float) and math.isfinite(value) else value
        return out


class Simulator:
    def __init__(self, cost: CostModel, config: SimConfig):
        if config.assist_device_hold not in ("iteration", "dense"):
            raise ValueError(f"assist_device_hold must be 'iteration' or 'dense', got {config.assist_device_hold!r}")
        self.cost = cost
        self.config = config
        profile = cost.profile
        self.vocab_size = profile.model.vocab_size
        self.block_size = profile.model.block_size
        self.engines: dict[str, _Engine] = {
            GPU: _Engine(GPU, "gpu", Scheduler(config.gpu_scheduler, profile.capacities.gpu_kv_blocks,
                                               self.block_size, config.max_context_tokens)),
        }
        if config.policy is not Policy.GPU_ONLY:
            self.engines[CPU] = _Engine(CPU, "cpu", Scheduler(config.cpu_scheduler, profile.capacities.cpu_kv_blocks,
                                                              self.block_size, config.max_context_tokens))
        self.admission = AdmissionConfig(policy=config.policy, itl_target_ms=config.itl_target_ms,
                                         cpu_max_running=config.cpu_scheduler.max_running, max_queue=config.max_queue)
        self.migration = MigrationConfig(
            kv_transfer_bytes_per_s=profile.kv_transfer.bytes_per_s,
            kv_transfer_fixed_ms=profile.kv_transfer.fixed_ms,
            migration_overhead_ms=config.migration_overhead_ms,
            kv_bytes_per_token=profile.model.kv_bytes_per_token,
            cpu_max_running=config.cpu_scheduler.max_running,
        )
        self.now_ms = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.device_free_at_ms = 0.0
        self.last_device_user = ""
        self.link_free_at_ms = 0.0
        self._wake_at: set[float] = set()
        self.tracks: dict[str, _Track] = {}
        self.index_of: dict[str, int] = {}
        self.queue: list[str] = []  # the router's wait queue
        self.num_rejected = 0
        self.num_handoffs = 0
        self.num_migrations = 0
        self.num_moves_without_kv = 0
        self._planner_armed = False
        self._idle_ticks = 0

    # ------------------------------------------------------------------ events

    def _push(self, at_ms: float, kind: str, payload=None) -> None:
        heapq.heappush(self._events, (at_ms, next(self._seq), kind, payload))

    def run(self, specs: Sequence[RequestSpec]) -> list[_Track]:
        for spec in specs:
            rid = f"req-{spec.index}"
            self.tracks[rid] = _Track(spec, rid)
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
                self._iteration_done(self.engines[payload])
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

    # ------------------------------------------------------------------ views

    def _contexts(self, engine: _Engine) -> list[int]:
        return [r.num_tokens for r in engine.scheduler.running]

    def _gpu_itl_ms(self, extra_context: int | None = None) -> float:
        contexts = self._contexts(self.engines[GPU])
        if extra_context is not None:
            contexts.append(extra_context)
        return self.cost.gpu_iteration_ms(0, DecodeBatch.of(contexts))

    def _cpu_itl_ms(self, extra_context: int | None = None) -> float:
        contexts = self._contexts(self.engines[CPU])
        if extra_context is not None:
            contexts.append(extra_context)
        if not contexts:
            return 0.0
        decode = DecodeBatch.of(contexts)
        if self.config.policy is Policy.GATED:  # once per GPU iteration, always assisted
            return self.cost.cpu_assisted_ms(decode) + self._gpu_itl_ms()
        return self.cost.cpu_iteration(decode).best_ms

    def _view(self, engine: _Engine, itl_ms: float) -> EngineView:
        blocks = engine.scheduler.blocks
        return EngineView(name=engine.name, kind=engine.kind, healthy=True,
                          kv_blocks_total=blocks.num_total_blocks, kv_blocks_used=blocks.num_used_blocks,
                          block_size=self.block_size, num_running=engine.scheduler.num_running,
                          num_waiting=engine.scheduler.num_waiting, itl_p50_ms=itl_ms, itl_p99_ms=itl_ms)

    def _views(self, new_context: int | None = None) -> dict[str, EngineView]:
        views = {GPU: self._view(self.engines[GPU], self._gpu_itl_ms(new_context))}
        if CPU in self.engines:
            views[CPU] = self._view(self.engines[CPU], self._cpu_itl_ms(new_context))
        return views

    def _routed(self) -> list[RoutedRequest]:
        out = []
        for track in self.tracks.values():
            if not track.engine or track.finish_ms is not None:
                continue
            out.append(RoutedRequest(track.request_id, track.engine, track.spec.input_len,
                                     len(track.token_times_ms), track.spec.output_len,
                                     migrating=track.migrating or track.handoff_to is not None))
        return out

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        self._admit_queued()
        gpu = self.engines[GPU]
        cpu = self.engines.get(CPU)
        if cpu is not None and self.config.policy is Policy.GATED:
            # the gate: the CPU goes at a GPU boundary, then the GPU; they take turns
            if self.last_device_user != "cpu" or not gpu.scheduler.has_work:
                self._try_start_cpu(cpu)
            self._try_start_gpu(gpu)
            self._try_start_cpu(cpu)
        else:
            self._try_start_gpu(gpu)
            if cpu is not None:
                self._try_start_cpu(cpu)
        if (self.config.policy is not Policy.GPU_ONLY and not self._planner_armed
                and any(t.finish_ms is None and t.engine for t in self.tracks.values())):
            self._planner_armed = True
            self._push(self.now_ms + self.config.planner_interval_ms, "plan")

    def _admit_queued(self) -> None:
        while self.queue:
            rid = self.queue[0]
            track = self.tracks[rid]
            placement, name = admit(track.spec.input_len, track.spec.output_len,
                                    self._views(track.spec.input_len + 1), self._routed(),
                                    len(self.queue) - 1, self.admission)
            if placement is Placement.WAIT:
                return
            self.queue.pop(0)
            if placement is Placement.REJECT:
                track.finish_ms = self.now_ms
                self.num_rejected += 1
                continue
            request = EngineRequest(rid, list(track.spec.prompt_token_ids),
                                    SamplingParams(max_tokens=track.spec.output_len, ignore_eos=True),
                                    seed=track.spec.index)
            try:
                self.engines[GPU].scheduler.add(request)  # prefill always runs on the GPU engine
            except (InvalidArgument, Overloaded):
                track.finish_ms = self.now_ms
                self.num_rejected += 1
                continue
            track.engine = GPU
            track.engines_seen.append(GPU)
            if placement is Placement.CPU:
                track.handoff_to = name

    def _device_wait_ms(self) -> float:
        return max(0.0, self.device_free_at_ms - self.now_ms)

    def _try_start_gpu(self, gpu: _Engine) -> None:
        if gpu.busy or not gpu.scheduler.has_work:
            return
        if self._device_wait_ms() > 0:
            self._wake(self.device_free_at_ms)
            return
        plan = gpu.scheduler.schedule()
        if plan.is_empty:
            return
        prefill_tokens, contexts = 0, []
        for seq in plan.sequences:
            if len(seq.token_ids) == 1 and seq.start_pos > 0 and seq.sample:
                contexts.append(seq.start_pos + 1)
            else:
                prefill_tokens += len(seq.token_ids)
        duration = self.cost.gpu_iteration_ms(prefill_tokens, DecodeBatch.of(contexts))
        self.device_free_at_ms = self.now_ms + duration
        self.last_device_user = "gpu"
        self._start(gpu, plan, duration)

    def _try_start_cpu(self, cpu: _Engine) -> None:
        if cpu.busy or not cpu.scheduler.has_work:
            return
        gated = self.config.policy is Policy.GATED
        if gated and self._device_wait_ms() > 0:  # the gate: wait for the GPU iteration's end
            self._wake(self.device_free_at_ms)
            return
        plan = cpu.scheduler.schedule()
        if plan.is_empty:
            return
        prefill_tokens, contexts, sampled = 0, [], 0
        for seq in plan.sequences:
            sampled += seq.sample
            if len(seq.token_ids) == 1 and seq.start_pos > 0 and seq.sample:
                contexts.append(seq.start_pos + 1)
            else:
                prefill_tokens += len(seq.token_ids)
        decode = DecodeBatch.of(contexts)
        cost = self.cost.cpu_iteration(decode, prefill_tokens, sampled)
        wait = self._device_wait_ms()
        if cost.assisted_ms is not None and (gated or wait + cost.assisted_ms < cost.local_ms):
            start = self.now_ms + wait
            held_ms = cost.assisted_ms if self.config.assist_device_hold == "iteration" else self.cost.assist_ms(decode.batch)
            self.device_free_at_ms = start + held_ms
            self.last_device_user = "cpu"
            cpu.num_assisted += 1
            self._start(cpu, plan, wait + cost.assisted_ms)
        else:
            cpu.num_local += 1
            self._start(cpu, plan, cost.local_ms)

    def _start(self, engine: _Engine, plan: StepPlan, duration_ms: float) -> None:
        engine.busy = True
        engine.plan = plan
        engine.num_iterations += 1
        engine.busy_ms += duration_ms
        self._push(self.now_ms + duration_ms, "done", engine.name)

    def _iteration_done(self, engine: _Engine) -> None:
        plan = engine.plan
        sampled = {seq.request_id: deterministic_token(self.index_of[seq.request_id], seq.sample_position,
                                                       self.vocab_size)
                   for seq in plan.sequences if seq.sample}
        events = engine.scheduler.apply(plan, StepResult(sampled))
        engine.busy = False
        engine.plan = None
        for event in events:
            track = self.tracks[event.request_id]
            for _ in event.new_token_ids:
                track.token_times_ms.append(self.now_ms)
            if event.finish_reason is not None:
                track.finish_ms = self.now_ms
                continue
            if track.handoff_to is not None and track.token_times_ms and not track.migrating:
                target = track.handoff_to
                self._move(track, engine, self.engines[target], handoff=True)
        self._run_commands(engine)

    def _run_commands(self, engine: _Engine) -> None:
        commands, engine.commands = engine.commands, []
        for command in commands:
            command()

    def _at_boundary(self, engine: _Engine, command: Callable[[], None]) -> None:
        if engine.busy:
            engine.commands.append(command)
        else:
            command()

    # ------------------------------------------------------------------ moves

    def _move(self, track: _Track, source: _Engine, target: _Engine, handoff: bool = False) -> None:
        track.migrating = True
        self._at_boundary(source, lambda: self._pause_and_send(track, source, target, handoff))

    def _end_move(self, track: _Track) -> None:
        track.migrating = False
        track.handoff_to = None

    def _pause_and_send(self, track: _Track, source: _Engine, target: _Engine, handoff: bool) -> None:
        rid = track.request_id
        if track.finish_ms is not None:
            self._end_move(track)
            return
        try:
            request = source.scheduler.pause(rid)
        except (InvalidArgument, RequestNotFound):
            self._end_move(track)
            return
        kv_tokens = request.num_tokens - 1 if request.num_computed_tokens > 0 else 0
        if kv_tokens == 0:
            self.num_moves_without_kv += 1  # a queued or preempted request: the target recomputes it
        try:
            target.scheduler.reserve_import(rid, kv_tokens)
        except (InvalidArgument, Overloaded):
            source.scheduler.resume(rid)
            self._end_move(track)
            return
        start = max(self.now_ms, self.link_free_at_ms)
        self.link_free_at_ms = start + self.cost.kv_transfer_ms(kv_tokens)
        moved = replace(request, output_token_ids=list(request.output_token_ids))
        self._push(self.link_free_at_ms, "call",
                   lambda: self._at_boundary(target, lambda: self._commit(track, moved, source, target, handoff)))

    def _commit(self, track: _Track, request: EngineRequest, source: _Engine, target: _Engine, handoff: bool) -> None:
        rid = track.request_id
        try:
            target.scheduler.commit_import(request)
        except (InvalidArgument, RequestNotFound):
            target.scheduler.cancel_import(rid)
            source.scheduler.resume(rid)
            self._end_move(track)
            return
        source.scheduler.release(rid, target.name)
        track.engine = target.name
        track.engines_seen.append(target.name)
        if handoff:
            self.num_handoffs += 1
        else:
            self.num_migrations += 1
        self._end_move(track)

    def _plan_tick(self) -> None:
        views = self._views()
        for move in plan_migrations(self._routed(), views, self.config.policy, self.migration):
            track = self.tracks[move.request_id]
            if track.migrating or track.finish_ms is not None:
                continue
            if self.config.skip_unprefilled_moves and not track.token_times_ms:
                continue
            self._move(track, self.engines[move.source], self.engines[move.target])

    # ------------------------------------------------------------------ results

    def result(self, rate: float) -> SimResult:
        completed = [t for t in self.tracks.values() if t.finish_ms is not None and t.token_times_ms]
        ttfts = [t.token_times_ms[0] - t.spec.arrival_s * 1000.0 for t in completed]
        itls = [b - a for t in completed for a, b in zip(t.token_times_ms, t.token_times_ms[1:])]
        tokens = sum(len(t.token_times_ms) for t in completed)
        start = min((t.spec.arrival_s * 1000.0 for t in self.tracks.values()), default=0.0)
        end = max((t.finish_ms for t in completed), default=start)
        duration_s = max(1e-9, (end - start) / 1000.0)
        gpu, cpu = self.engines[GPU], self.engines.get(CPU)

        def pct(values: list[float], q: float) -> float | None:
            return percentile(values, q) if values else None

        return SimResult(
            policy=self.config.policy.value, rate=rate, num_requests=len(self.tracks),
            requests_completed=len(completed), requests_rejected=self.num_rejected, duration_s=duration_s,
            throughput_tokens_per_s=tokens / duration_s, requests_per_s=len(completed) / duration_s,
            p50_ttft_ms=pct(ttfts, 50), p99_ttft_ms=pct(ttfts, 99), p50_itl_ms=pct(itls, 50),
            p99_itl_ms=pct(itls, 99), mean_itl_ms=sum(itls) / len(itls) if itls else None,
            num_generated_tokens=tokens, num_handoffs=self.num_handoffs, num_migrations=self.num_migrations,
            num_moves_without_kv=self.num_moves_without_kv,
            num_preemptions=sum(e.scheduler.num_preemptions for e in self.engines.values()),
            gpu_iterations=gpu.num_iterations, cpu_iterations=cpu.num_iterations if cpu else 0,
            cpu_local_iterations=cpu.num_local if cpu else 0, cpu_assisted_iterations=cpu.num_assisted if cpu else 0,
            requests_touching_cpu=sum(1 for t in self.tracks.values() if CPU in t.engines_seen),
            gpu_busy_fraction=min(1.0, gpu.busy_ms / 1000.0 / duration_s),
            cpu_busy_fraction=min(1.0, cpu.busy_ms / 1000.0 / duration_s) if cpu else 0.0,
        )


def simulate(cost: CostModel, config: SimConfig, specs: Sequence[RequestSpec], rate: float = math.nan) -> SimResult:
    """Run `specs` through the simulated deployment and summarize."""
    sim = Simulator(cost, config)
    sim.run(specs)
    return sim.result(rate)
