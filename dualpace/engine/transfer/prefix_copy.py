"""Send the cached leading blocks of a token sequence to another engine's prefix cache.

The one transfer both host-tier directions use: the GPU engine offering a finished request's
blocks to the CPU engine's pool (dualpace.engine.transfer.host_tier), and the CPU engine copying a
host-resident prefix back to the GPU engine (the CopyPrefix RPC, when the router's cost rule
prefers that to decoding on the CPU engine; dualpace.policy.host_tier).

Between steps the leading run of full blocks this engine still caches is found by hash and
pinned (a table of its own), so no step evicts or overwrites them while the transport reads them
(in its own threads, off the step loop); the pin is dropped however the transfer ends. The
header is cache-only with skip_cached: the target first says how many leading tokens it caches
already (whole blocks of its own) and only the KV after them is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Container

from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvTransferHeader, PrefixCopy
from dualpace.engine.loop import EngineLoop
from dualpace.engine.transfer.migration import engine_kv_layout
from dualpace.errors import FailedPrecondition
from dualpace.sampling_params import SamplingParams

SourceFrom = Callable[[int], OutgoingKv]  # the KV of the tokens from this one on (their slots)
# send(header, source_from) -> (target engine, leading tokens it held): one cache-only import
SendCache = Callable[[KvTransferHeader, SourceFrom], Awaitable[tuple[str, int]]]


async def send_cached_prefix(loop: EngineLoop, send: SendCache, token_ids: tuple[int, ...], pin_id: str,
                             skip_chains: Container[bytes] = ()) -> PrefixCopy | None:
    """Send the leading full blocks of `token_ids` this engine caches; None when it caches none of
    them (or their last block's hash is in `skip_chains`: sent before). Raises what `send` raises."""
    if loop.core.scheduler.prefix_cache is None:
        raise FailedPrecondition("this engine runs with --prefix-caching off: it has no cached prefix to send")
    pinned = await loop.call(lambda: _pin(loop, pin_id, token_ids, skip_chains))
    if pinned is None:
        return None
    num_tokens, last_hash, slot_ids = pinned
    try:
        # The pinned blocks' KV from the first token the target does not hold on.
        engine, num_held = await send(_header(loop, pin_id, token_ids[:num_tokens]),
                                      lambda first_token: OutgoingKv(loop.core.runner.kv, slot_ids[first_token:]))
    finally:
        await _unpin(loop, pin_id)
    return PrefixCopy(num_tokens, num_tokens - min(num_held, num_tokens), engine, last_hash)


def _pin(loop: EngineLoop, pin_id: str, token_ids: tuple[int, ...],
         skip_chains: Container[bytes]) -> tuple[int, bytes, list[int]] | None:
    """Between steps: hold the cached leading blocks of token_ids so no step evicts them."""
    scheduler = loop.core.scheduler
    hashes = scheduler.prefix_cache.hasher.chain(token_ids)
    block_ids = scheduler.blocks.match_prefix(hashes)
    if not block_ids or hashes[len(block_ids) - 1] in skip_chains:
        return None
    num_tokens = len(block_ids) * scheduler.blocks.block_size
    scheduler.blocks.allocate(pin_id, num_tokens, block_ids)
    return num_tokens, hashes[len(block_ids) - 1], loop.core.kv_slot_ids(pin_id, num_tokens)


async def _unpin(loop: EngineLoop, pin_id: str) -> None:
    blocks = loop.core.scheduler.blocks
    try:
        await asyncio.shield(loop.call(lambda: blocks.free(pin_id) if blocks.has(pin_id) else None))
    except Exception:  # noqa: BLE001 - stopping: the pool goes with the engine
        pass


def _header(loop: EngineLoop, pin_id: str, token_ids: tuple[int, ...]) -> KvTransferHeader:
    layout = engine_kv_layout(loop)
    num_tokens = len(token_ids)
    core = loop.core
    return KvTransferHeader(
        request_id=pin_id, prompt_token_ids=token_ids, output_token_ids=(),
        params=SamplingParams(max_tokens=1, seed=0), num_computed_tokens=num_tokens, layout=layout,
        total_bytes=2 * layout.num_layers * num_tokens * layout.bytes_per_token_per_layer,
        source_engine=core.config.name, cache_only=True, cache_salt=core.scheduler.prefix_cache.hasher.salt,
        skip_cached=True)

