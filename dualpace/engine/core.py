"""EngineCore: the scheduler and the runner joined into a plain, synchronous engine.

No asyncio, no grpc: the daemon's loop (dualpace.engine.loop) calls `step()` in a
worker thread and applies commands between steps; tests can drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpace.engine.request import EngineRequest, RequestEvent
from dualpace.engine.runner import ModelRunner
from dualpace.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from dualpace.engine.sliding_window import split_kv_blocks
from dualpace.errors import InvalidArgument
from dualpace.kv.events import KvEventLog
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.model.config import ModelConfig
from dualpace.model.loader import LoadedModel
from dualpace.sampling import SamplingParams
from dualpace.sampling_params import pick_seed
from dualpace.validation import validate_request


@dataclass(frozen=True)
class EngineConfig:
    name: str = "engine"
    kind: str = "gpu"  # "gpu" | "cpu": which role this engine plays in the system
    num_kv_blocks: int = 1024
    block_size: int = 16
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefix_caching: bool = True  # reuse the KV of full blocks whose prefix was computed before
    cpu_kernel_variant: str = "off"  # dualpace.model.cpu_kernels variant in use ("off": torch ops; CUDA: n/a)


def prefix_cache_salt(loaded: LoadedModel) -> str:
    """Names the model, its weights as held (--weights mode and matrix formats) and the compute
    dtype, so KV is only reused, here or from another engine's host tier, under the same weights."""
    return (f"{loaded.name}|{loaded.path.name}|{loaded.config.architecture}|{loaded.model.dtype}"
            f"|{loaded.weights_format}")


def kv_pool_sizes(model: ModelConfig, config: EngineConfig) -> tuple[int, int]:
    """(blocks of the first pool, blocks of the sliding layers' own pool, 0 for none) from the
    budget of config.num_kv_blocks blocks of every layer. A model mixing sliding and global layers
    (Gemma 3) gives its sliding layers a pool of their own, which frees what the window has passed
    (dualpace.engine.sliding_window.split_kv_blocks); any other model has one pool."""
    if not model.mixes_window_and_global_layers:
        return config.num_kv_blocks, 0
    return split_kv_blocks(config.num_kv_blocks, model.num_layers, sum(model.window_layers), model.sliding_window,
                           config.block_size, config.scheduler.max_running, config.scheduler.max_batch_tokens)


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, runner: ModelRunner | None = None):
        """`runner`: one whose KV storage has the pools kv_pool_sizes gives (ModelRunner's num_blocks
        and num_window_blocks); by default one is made."""
        self.loaded = loaded
        self.config = config
        num_blocks, num_window_blocks = kv_pool_sizes(loaded.config, config)
        # The CPU engine passes a runner that can also run iterations with Dense Assist.
        self.runner = runner or ModelRunner(loaded, num_blocks, config.block_size, num_window_blocks=num_window_blocks)
        kv = self.runner.kv
        if (kv.has_window_pool != bool(num_window_blocks) or kv.num_window_blocks < num_window_blocks
                or kv.num_blocks < num_blocks):
            raise ValueError(f"the runner's KV pools ({kv.num_blocks}, {kv.num_window_blocks} blocks) are not the "
                             f"engine's ({num_blocks}, {num_window_blocks}): see kv_pool_sizes")
        eos_ids = frozenset(loaded.config.eos_token_ids) | frozenset(loaded.tokenizer.eos_token_ids)
        hasher = BlockHasher(config.block_size, prefix_cache_salt(loaded)) if config.prefix_caching else None
        events = KvEventLog(config.kind, config.block_size) if config.prefix_caching else None
        # The window slides over the sliding layers' own pool, or over the one pool when every layer slides.
        window = loaded.config.sliding_window if num_window_blocks else loaded.config.window_of_every_layer
        self.scheduler = Scheduler(
            config.scheduler, num_blocks, config.block_size, loaded.max_context_tokens, eos_ids, hasher, events,
            sliding_window_tokens=window, num_window_blocks=num_window_blocks,
        )
        self.num_steps = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    num_prior_output_tokens: int = 0, hold_after_first_token: bool = False) -> EngineRequest:
        """Validate and queue a new request (raises InvalidArgument / Overloaded). A re-submission
        after an engine failure names how many of the prompt's last tokens were output before;
        hold_after_first_token: it is paused after its first token for a hand-off (Scheduler.apply)."""
        validate_request(prompt_token_ids, params, self.loaded.config.vocab_size, self.loaded.max_context_tokens)
        if not 0 <= num_prior_output_tokens < len(prompt_token_ids):
            raise InvalidArgument("num_prior_output_tokens",
                                  f"must be in [0, {len(prompt_token_ids)}) (below the prompt's length)")
        request = EngineRequest(request_id, list(prompt_token_ids), params, pick_seed(params),
                                num_prior_output_tokens=num_prior_output_tokens,
                                hold_after_first_token=hold_after_first_token)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> RequestEvent:
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        """Own requests to run, or remote rows waiting for a step (the runner's JoinDesk)."""
        desk = getattr(self.runner, "desk", None)
        return self.scheduler.has_work or (desk is not None and desk.has_pending)

    def step(self) -> tuple[StepPlan, list[RequestEvent]]:
        """One iteration: plan, run the model, apply the results. With joins pending the step runs
        even when this engine has nothing of its own (the plan stays empty)."""
        plan = self.scheduler.schedule()
        desk = getattr(self.runner, "desk", None)
        if plan.is_empty and (desk is None or not desk.has_pending):
            return plan, []
        result = self.runner.execute(plan)
        self.num_steps += 1
        return plan, self.scheduler.apply(plan, result)

    @property
    def moves_kv(self) -> bool:
        """Whether a request moves to another engine with its KV. Not when the sliding layers hold a
        pool of their own: a transfer carries one slot list for every layer, so such a request moves
        without KV and the target recomputes it (both pools rebuilt by its prefill)."""
        return not self.runner.kv.has_window_pool

    def kv_slot_ids(self, request_id: str, num_tokens: int) -> list[int]:
        """Flat slots of the request's first `num_tokens` tokens. Positions a sliding window returned
        to the pool give the slots of the first held block instead: a transfer carries them as filler
        that the target's window masks, and the target returns those blocks at its commit."""
        blocks = self.scheduler.blocks
        num_released = min(blocks.num_released_tokens(request_id), num_tokens)
        held = blocks.slot_ids(request_id, num_released, num_tokens)
        if not num_released:
            return held
        first_held_slot = blocks.block_ids(request_id)[num_released // blocks.block_size] * blocks.block_size
        return [first_held_slot + pos % blocks.block_size for pos in range(num_released)] + held
