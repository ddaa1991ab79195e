"""The scheduler's commands for a request's move to another engine: `pause` takes it out of the batch
at a step boundary with its blocks kept, `release` forgets it once it lives elsewhere, and `resume` /
`release_hold` put it back when no move takes it. Pure, as the scheduler is; mixed into Scheduler."""

from __future__ import annotations

from dualpace.engine.request import EngineRequest, RequestEvent, RequestState
from dualpace.errors import InvalidArgument


class MoveCommands:
    """Reads the Scheduler's requests, waiting and running lists and block pools."""

    def pause(self, request_id: str) -> EngineRequest:
        """Hold a request at this step boundary for export, keeping its blocks. A decoding
        request's cache then holds every token but the last sampled one; a waiting request
        (queued or preempted) holds no KV and moves without any (the target recomputes it).
        A request held after its first token (`apply`) is already paused: the move takes it."""
        request = self._get(request_id)
        if request.state == RequestState.PAUSED and request.hold_after_first_token:
            request.hold_after_first_token = False  # taken by this move: no longer waiting for one
            return request
        if request.state == RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state == RequestState.RUNNING and request.num_pending_tokens == 1 and request.output_token_ids:
            self.running.remove(request)
        elif request.state == RequestState.PAUSED:
            raise InvalidArgument("request_id", f"request {request_id!r} is already paused for another move")
        else:
            raise InvalidArgument("request_id", f"request {request_id!r} is still prefilling (state {request.state.value})")
        request.state = RequestState.PAUSED
        return request

    def resume(self, request_id: str) -> None:
        """Put a paused request back where it was (e.g. after a failed export)."""
        request = self._get(request_id)
        if request.state != RequestState.PAUSED:
            raise InvalidArgument("request_id", f"request {request_id!r} is not paused")
        request.hold_after_first_token = False
        if request.num_computed_tokens == 0:
            request.state = RequestState.WAITING
            self._insert_waiting(request)
        else:
            request.state = RequestState.RUNNING
            self._insert_running(request)

    def release_hold(self, request_id: str) -> bool:
        """A request held after its first token that no move took: it decodes here after all.
        False when there is no such request (taken by a move, aborted or finished meanwhile)."""
        request = self.requests.get(request_id)
        if request is None or request.state != RequestState.PAUSED or not request.hold_after_first_token:
            return False
        self.resume(request_id)
        return True

    def release(self, request_id: str, migrated_to: str) -> RequestEvent:
        """A paused request now lives elsewhere: free its blocks and forget it."""
        request = self._get(request_id)
        if request.state != RequestState.PAUSED:
            raise InvalidArgument("request_id", f"request {request_id!r} is not paused")
        self._free_blocks(request_id)
        request.state = RequestState.FINISHED
        del self.requests[request_id]
        return RequestEvent(request_id, migrated_to=migrated_to)
