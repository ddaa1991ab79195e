"""The router's view of the simulated engines: KV use and running/waiting counts as the last
WatchLoad snapshot gave them, and each engine's predicted ITL from the profile's cost model.

A part of profiles.sim.simulator.Simulator (mixed in, like CpuSteps). Pure arithmetic.
"""

from __future__ import annotations

from dualpace.policy.policies import traits
from dualpace.policy.views import EngineView, RoutedRequest
from dualpace.profile.cost_model import DecodeBatch
from profiles.sim.config import CPU, GPU


class RouterViews:
    """Simulator methods that build the router's views (mixed into Simulator)."""

    def _contexts(self, engine) -> list[int]:
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
        if traits(self.config.policy).cpu_decodes_inside_gpu_steps:  # once per GPU iteration, always assisted
            return self.cost.cpu_assisted_ms(decode) + self._gpu_itl_ms()
        return self.cost.cpu_iteration(decode).best_ms

    def _snapshot(self, engine) -> tuple[int, int, int]:
        """(KV blocks used, running, waiting) as the router last heard them: the engine's state
        when its last WatchLoad snapshot was taken, one at most every view_interval_ms (the
        router counts its own placements on top, dualpace.policy.views.estimated_blocks_used)."""
        taken_ms, state = self._snapshots.get(engine.name, (None, None))
        if taken_ms is None or self.now_ms - taken_ms >= self.config.view_interval_ms:
            scheduler = engine.scheduler
            state = (scheduler.blocks.num_used_blocks, scheduler.num_running, scheduler.num_waiting)
            self._snapshots[engine.name] = (self.now_ms, state)
        return state

    def _view(self, engine, itl_ms: float) -> EngineView:
        used, running, waiting = self._snapshot(engine)
        return EngineView(name=engine.name, kind=engine.kind, healthy=True,
                          kv_blocks_total=engine.scheduler.blocks.num_total_blocks, kv_blocks_used=used,
                          block_size=self.block_size, num_running=running,
                          num_waiting=waiting, itl_p50_ms=itl_ms, itl_p99_ms=itl_ms)

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
                                     migrating=track.migrating,
                                     num_migrations=track.num_moves))
        return out
