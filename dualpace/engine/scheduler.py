"""The engine scheduler: continuous batching with chunked prefill under a token
budget, admission only while KV suffices, and preemption by recompute.

Pure: no torch, grpc, asyncio or clock reads. The engine loop calls `schedule()` -> runs the
plan -> `apply(plan, result)`; commands (add, abort, pause for migration, import) are applied
between steps. The simulator drives the same class with a cost model as its clock.

Prefix caching (when built with a BlockHasher): a new or preempted request is admitted on the
longest run of cached full blocks matching its tokens, at most all but its last token (so the
first sampled token's logits are computed), and its prefill starts at the end of that run. Each
block a request fills is registered in the cache as soon as its KV is computed. Cached blocks
count as available: they are evicted before any running request is preempted.

Sliding window (built with `sliding_window_tokens`): see SlidingWindowBlocks. With every layer sliding
(Mistral, Phi-3) the one pool slides; a model whose global layers need the whole context (Gemma 3) is
built with `num_window_blocks` too: its sliding layers then have a pool of their own, which slides,
while the first pool serves the global layers and keeps every block. A request holds a table in each
pool, both advanced together; the plan carries the sliding layers' table as `window_block_ids`.

Hand-off hold: a request marked `hold_after_first_token` is paused in the apply of the step that
samples its first token (its event says `held`), so the next step never runs it and its move
(`pause` takes it as it is) need not wait for that step; `release_hold` lets it decode here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dualpace.engine.prefix_cache import PrefixCache
from dualpace.engine.request import EngineRequest, RequestEvent, RequestState
from dualpace.engine.scheduler_moves import MoveCommands
from dualpace.engine.scheduler_pools import PoolReservations
from dualpace.engine.sliding_window import SlidingWindowBlocks
from dualpace.errors import InvalidArgument, Overloaded, RequestNotFound
from dualpace.kv.block_table import KVBlockManager
from dualpace.kv.events import KvEventLog
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.logprobs import merge_prompt_logprobs, prompt_logprobs_with_first_token
from dualpace.engine.step_plan import ScheduledSequence, StepPlan, StepResult
from dualpace.penalties import context_for
from dualpace.sampling_params import FinishReason, stop_reason


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 512  # tokens per step: decodes + prefill chunks
    max_running: int = 64  # sequences per step
    max_waiting: int = 256  # queued requests before add() raises Overloaded


class Scheduler(MoveCommands, PoolReservations):
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_context_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        block_hasher: BlockHasher | None = None,
        kv_events: KvEventLog | None = None,
        sliding_window_tokens: int | None = None,
        num_window_blocks: int = 0,
    ):
        self.config = config
        self.blocks = KVBlockManager(num_blocks, block_size)  # the global layers' pool, or every layer's
        # The sliding layers' own pool (num_window_blocks > 0, a model with global layers too); None: they use blocks.
        self.window_blocks = None
        if num_window_blocks:
            if sliding_window_tokens is None:
                raise ValueError("a pool of the sliding layers' own needs sliding_window_tokens")
            self.window_blocks = KVBlockManager(num_window_blocks, block_size)
        self.pools = [self.blocks] if self.window_blocks is None else [self.blocks, self.window_blocks]
        # Over the pool that slides (the last one); None: attention sees the whole context.
        self.window = None
        if sliding_window_tokens is not None:
            self.window = SlidingWindowBlocks(sliding_window_tokens, self.pools[-1])
        self.max_context_tokens = max_context_tokens
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: list[EngineRequest] = []  # arrival order; preempted requests go back in order
        self.running: list[EngineRequest] = []  # arrival order
        self._importing: set[str] = set()
        self._reserved_ahead: set[str] = set()  # imports reserved before their request was known
        self._next_arrival_index = 0
        self.num_preemptions = 0
        # None: prefix caching off.
        self.prefix_cache = None if block_hasher is None else PrefixCache(self.pools, block_hasher, kv_events,
                                                                          sliding_window_tokens)
        # Told of each finishing request before its blocks are freed (the host tier's offers).
        self.finished_listener: Callable[[EngineRequest, FinishReason], None] | None = None

    # ----------------------------------------------------------------- commands

    def add(self, request: EngineRequest) -> None:
        """Queue a new request. Raises InvalidArgument if it can never fit, Overloaded if the queue is full."""
        self._check_new_id(request.request_id)
        self._check_fits(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise Overloaded(f"the engine's queue is full ({self.config.max_waiting} waiting requests)")
        request.state = RequestState.WAITING
        request.num_computed_tokens = 0
        request.arrival_index = self._take_arrival_index()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> RequestEvent:
        """Drop a request wherever it is and free its blocks."""
        if request_id in self._importing:
            self.cancel_import(request_id)
            return RequestEvent(request_id, finish_reason=FinishReason.ABORT)
        request = self._get(request_id)
        self._finish(request, FinishReason.ABORT)
        return RequestEvent(request_id, finish_reason=FinishReason.ABORT)

    def reserve_import(self, request_id: str, num_kv_tokens: int, held_block_ids: Sequence[int] = (),
                       ahead: bool = False) -> list[int]:
        """Phase one of an import: allocate blocks for `num_kv_tokens` of incoming KV. A cache-only
        import names the cached leading blocks it shares (held_block_ids: referenced, so kept).
        ahead: reserved for a transfer to come, which adopt_import gives them to."""
        self._check_new_id(request_id)
        held = list(held_block_ids)
        for pool in self.pools:
            if not pool.can_allocate(num_kv_tokens + 1, held if pool is self.blocks else []):
                raise Overloaded(
                    f"not enough free KV blocks to import {num_kv_tokens} tokens "
                    f"({pool.num_available_blocks} of {pool.num_total_blocks} free or cached)"
                )
        self._importing.add(request_id)
        if ahead:
            self._reserved_ahead.add(request_id)
        for pool in self.pools[1:]:
            pool.allocate(request_id, num_kv_tokens)
        return self.blocks.allocate(request_id, num_kv_tokens, held)

    @property
    def num_used_blocks(self) -> int:
        """Blocks of the KV pool that requests and imports under way hold; those reserved ahead of a
        transfer are not counted (they stand for the next import, as free blocks would)."""
        return self.blocks.num_used_blocks - sum(self.blocks.num_held_blocks(i) for i in self._reserved_ahead)

    def adopt_import(self, reserved_id: str, request_id: str, num_kv_tokens: int) -> None:
        """An import reserved ahead under `reserved_id` (reserve_import, before its request was known)
        becomes `request_id`'s, cut to `num_kv_tokens` (the rest of its blocks freed); commit_import
        follows as for any import."""
        if reserved_id not in self._importing:
            raise RequestNotFound(reserved_id)
        self._check_new_id(request_id)
        for pool in self.pools:
            if num_kv_tokens > pool.num_tokens(reserved_id):
                raise InvalidArgument("num_computed_tokens", f"{num_kv_tokens} tokens do not fit the "
                                      f"{pool.num_tokens(reserved_id)} reserved ahead")
        for pool in self.pools:
            pool.hand_over(reserved_id, request_id, num_kv_tokens)
        self._importing.discard(reserved_id)
        self._reserved_ahead.discard(reserved_id)
        self._importing.add(request_id)

    def commit_import(self, request: EngineRequest) -> None:
        """Phase two: the KV is written and verified; the request joins the running batch.
        A request imported without KV joins the queue and is prefilled here."""
        if request.request_id not in self._importing:
            raise RequestNotFound(request.request_id)
        num_kv_tokens = self.blocks.num_tokens(request.request_id)
        if num_kv_tokens not in (0, request.num_tokens - 1):
            raise InvalidArgument("num_computed_tokens", "imported KV must cover all tokens but the last, or none")
        self._check_fits(request)  # else, once preempted, it could never be readmitted
        self._importing.discard(request.request_id)
        request.arrival_index = self._take_arrival_index()
        self.requests[request.request_id] = request
        if num_kv_tokens == 0:
            self._free_blocks(request.request_id)
            request.state = RequestState.WAITING
            request.num_computed_tokens = 0
            self._insert_waiting(request)
            return
        request.state = RequestState.RUNNING
        request.num_computed_tokens = num_kv_tokens
        # Its blocks enter the prefix cache after its first step here (apply), not now: the commit is
        # on the source's path (hashing a 1024-token import cost ~0.1 ms of its ~0.5 ms commit). Where
        # blocks leave a sliding window now, they are cached first, as after every step.
        if self.window is not None:
            self._cache_full_blocks(request)
            self._release_outside_window(request)
        self._insert_running(request)

    def commit_cache_import(self, request_id: str, token_ids: list[int]) -> int:
        """Phase two of a host-tier import: the reserved blocks hold ``token_ids``' KV and enter
        the prefix cache unreferenced (evictable, LRU). How many blocks were new here."""
        if request_id not in self._importing or self.blocks.num_tokens(request_id) != len(token_ids):
            raise InvalidArgument("request_id", f"{request_id!r} is no cache-only import of {len(token_ids)} tokens")
        self._importing.discard(request_id)
        num_new = 0 if self.prefix_cache is None else self.prefix_cache.store_blocks(request_id, token_ids)
        self.blocks.free(request_id)
        return num_new

    def cancel_import(self, request_id: str) -> None:
        if request_id in self._importing:
            self._importing.discard(request_id)
            self._reserved_ahead.discard(request_id)
            self._free_blocks(request_id)

    # ----------------------------------------------------------------- stepping

    def schedule(self) -> StepPlan:
        budget = self.config.max_batch_tokens
        sequences: list[ScheduledSequence] = []
        preempted: list[str] = []
        for request in list(self.running):
            if request.state != RequestState.RUNNING:  # preempted earlier in this loop
                continue
            if budget == 0 or len(sequences) >= self.config.max_running:
                break
            num_new = min(request.num_pending_tokens, budget)
            if not self._reserve_kv(request, num_new, preempted):
                continue
            sequences.append(self._scheduled(request, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and not preempted and len(sequences) < self.config.max_running:
            request = self.waiting[0]
            cached_block_ids = self._match_prefix(request)  # per pool
            reservations = self._admission_reservations(request, cached_block_ids, budget)
            if not all(self._can_admit(*reservation) for reservation in reservations):
                break
            self.waiting.pop(0)
            for pool, num_reserved_tokens, cached in reservations:
                pool.allocate(request.request_id, num_reserved_tokens, cached)
            self._start_after_cached_prefix(request, len(cached_block_ids[0]) * self.blocks.block_size)
            self._release_outside_window(request)
            request.state = RequestState.RUNNING
            self._insert_running(request)
            num_new = min(request.num_pending_tokens, budget)
            sequences.append(self._scheduled(request, num_new))
            budget -= num_new
        return StepPlan(tuple(sequences), tuple(preempted))

    def apply(self, plan: StepPlan, result: StepResult) -> list[RequestEvent]:
        events = []
        for seq in plan.sequences:
            request = self.requests.get(seq.request_id)
            if request is None or request.state != RequestState.RUNNING:
                continue
            request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            self._cache_full_blocks(request)
            self._release_outside_window(request)
            if seq.request_id in result.prompt_logprobs:
                merge_prompt_logprobs(request.prompt_logprobs, result.prompt_logprobs[seq.request_id])
            if not seq.sample:
                continue
            token_id = result.sampled_token_ids.get(seq.request_id)
            if token_id is None:
                self._finish(request, FinishReason.ERROR)
                events.append(RequestEvent(seq.request_id, finish_reason=FinishReason.ERROR))
                continue
            request.output_token_ids.append(token_id)
            reason = stop_reason(token_id, len(request.output_token_ids), request.params, self.eos_token_ids)
            if reason is None and request.num_tokens >= self.max_context_tokens:
                reason = FinishReason.LENGTH
            held = reason is None and request.hold_after_first_token and len(request.output_token_ids) == 1
            if reason is not None:
                self._finish(request, reason)
            elif held:  # its hand-off follows: out of the next steps, so the move starts at once
                self.running.remove(request)
                request.state = RequestState.PAUSED
            events.append(RequestEvent(seq.request_id, (token_id,), reason, num_cached_tokens=request.num_cached_tokens,
                                       logprobs=(result.logprobs.get(seq.request_id),),
                                       prompt_logprobs=prompt_logprobs_with_first_token(request), held=held))
        return events

    # ----------------------------------------------------------------- queries

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_prefix_query_tokens(self) -> int:
        """Tokens of admitted requests looked up in the prefix cache (0 with caching off)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_query_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Of those, tokens whose KV the cache held."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_hit_tokens

    @property
    def num_window_released_blocks(self) -> int:
        """Blocks the sliding window returned to the pool (0 without a window)."""
        return 0 if self.window is None else self.window.num_released_blocks

    def get(self, request_id: str) -> EngineRequest:
        return self._get(request_id)

    # ----------------------------------------------------------------- internals

    def _get(self, request_id: str) -> EngineRequest:
        request = self.requests.get(request_id)
        if request is None:
            raise RequestNotFound(request_id)
        return request

    def _check_new_id(self, request_id: str) -> None:
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if request_id in self.requests or request_id in self._importing:
            raise InvalidArgument("request_id", f"a request {request_id!r} already exists in this engine")

    def _take_arrival_index(self) -> int:
        self._next_arrival_index += 1
        return self._next_arrival_index

    def _insert_running(self, request: EngineRequest) -> None:
        index = len(self.running)
        while index > 0 and self.running[index - 1].arrival_index > request.arrival_index:
            index -= 1
        self.running.insert(index, request)

    def _match_prefix(self, request: EngineRequest) -> list[list[int]]:
        """Per pool, the cached blocks the request's table starts with."""
        return [[] for _ in self.pools] if self.prefix_cache is None else self.prefix_cache.match(request)

    def _start_after_cached_prefix(self, request: EngineRequest, num_hit_tokens: int) -> None:
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens is None:  # the first admission is the one the client's usage reports
            request.num_cached_tokens = min(num_hit_tokens, len(request.prompt_token_ids))
        if self.prefix_cache is not None:
            self.prefix_cache.count_lookup(request, num_hit_tokens)

    def _cache_full_blocks(self, request: EngineRequest) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.cache_full_blocks(request)

    def _preempt(self, request: EngineRequest) -> None:
        """Free the request's KV and queue it to recompute prompt + generated tokens."""
        self.running.remove(request)
        self._free_blocks(request.request_id)
        request.state = RequestState.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._insert_waiting(request)

    def _insert_waiting(self, request: EngineRequest) -> None:
        """Queue in arrival order (a preempted request keeps its place)."""
        index = 0
        while index < len(self.waiting) and self.waiting[index].arrival_index < request.arrival_index:
            index += 1
        self.waiting.insert(index, request)

    def _scheduled(self, request: EngineRequest, num_new: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids(start, start + num_new)),
            start_pos=start,
            block_ids=tuple(self.blocks.block_ids(request.request_id)),
            window_block_ids=None if self.window_blocks is None else tuple(
                self.window_blocks.block_ids(request.request_id)),
            sample=sample,
            params=request.params,
            seed=request.seed,
            guided_token_ids=request.guided_token_ids() if sample and request.params.guided is not None else (),
            context=context_for(request, self.eos_token_ids),
        )

    def _finish(self, request: EngineRequest, reason: FinishReason) -> None:
        if request.state == RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state == RequestState.RUNNING:
            self.running.remove(request)
        if self.finished_listener is not None:
            self.finished_listener(request, reason)
        self._free_blocks(request.request_id)
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)
