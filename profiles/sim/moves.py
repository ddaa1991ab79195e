"""The simulated migrations (the hand-off included), as the engines run them: the source
pauses the request at a step boundary (Scheduler.pause), blocks are reserved on the target
(reserve_import), the KV crosses one shared link (the profile's transfer time), the target
commits at its next boundary (commit_import) and the source releases. A failed reservation
or commit resumes the request on the source.

A part of profiles.sim.simulator.Simulator (it uses the simulator's clock, engines and
event queue); kept apart so each file reads on its own.
"""

from __future__ import annotations

from dataclasses import replace

from dualpace.engine.request import EngineRequest
from dualpace.errors import InvalidArgument, Overloaded, RequestNotFound


class Moves:
    """Simulator methods that move a request between engines (mixed into Simulator)."""

    def _move(self, track, source, target, handoff: bool = False) -> None:
        track.migrating = True
        self._at_boundary(source, lambda: self._pause_and_send(track, source, target, handoff))

    def _end_move(self, track) -> None:
        track.migrating = False
        track.handoff_to = None

    def _pause_and_send(self, track, source, target, handoff: bool) -> None:
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

    def _commit(self, track, request: EngineRequest, source, target,
                handoff: bool) -> None:
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
        track.num_moves += 1
        if handoff:
            self.num_handoffs += 1
        else:
            self.num_migrations += 1
        self._end_move(track)
