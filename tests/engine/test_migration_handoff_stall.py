"""A migration must not stall either engine's steps or the client's resume (no timing assertions).

- Source: once the target has committed, the request's stream ends with `migrated_to` at once,
  even while the source cannot reach a step boundary (its step lock held), so the client
  resumes on the target without waiting for the source's step in flight; the source still
  frees the request's blocks at its next boundary, before migrate_out returns.
- Target: the receive of the KV into its blocks and the checksums over what landed run in a
  worker thread, never on the event loop thread that drives the engine's steps and streams.
"""

from __future__ import annotations

import asyncio
import threading

from dualpace.engine.transfer import kv_tcp_data
from dualpace.engine.transfer.migration import migrate_out
from dualpace.generation import OfflineGenerator
from dualpace.sampling import SamplingParams
from tests.engine.test_migration import started, stop, wait_tokens
from tests.helpers import data_socket_send

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


async def until_moved(channel) -> None:
    async for _ in channel.follow():
        pass
    assert channel.migrated_to is not None


async def test_stream_ends_at_commit_without_waiting_for_a_source_step(tiny):
    lock = threading.Lock()
    source = await started(tiny, "src", step_lock=lock)
    source_loop = source[0]
    target = await started(tiny, "dst", block_size=4)
    # Another request keeps the source stepping, so its commands wait for step boundaries.
    busy = await source_loop.add_request("busy", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    channel = await source_loop.add_request("m", PROMPT, params)
    await wait_tokens(channel, 4)
    inner = data_socket_send(target[0])
    holding = asyncio.Event()

    async def send(header, outgoing) -> str:
        engine = await inner(header, outgoing)  # committed on the target
        await asyncio.to_thread(lock.acquire)  # from now on no source step can finish
        holding.set()
        return engine

    migration = asyncio.create_task(migrate_out(source_loop, "m", send))
    try:
        await holding.wait()
        # The stream ends although the source is held inside a step (10 s: a failure bound only).
        await asyncio.wait_for(until_moved(channel), timeout=10)
        assert channel.migrated_to == "dst"
        assert not busy.done
        assert not migration.done()  # the blocks are freed at the source's next boundary
    finally:
        if lock.locked():
            lock.release()
    stats = await migration
    assert stats.target_engine == "dst"
    assert "m" not in source_loop.core.scheduler.requests
    emitted = len(channel.output_token_ids)
    rest = [t async for update in target[0].channel("m").follow(emitted) for t in update.new_token_ids]
    expected = OfflineGenerator(tiny).generate([PROMPT], [params])[0].output_token_ids
    assert channel.output_token_ids + rest == expected
    await source_loop.abort("busy")
    assert source_loop.load().kv_blocks_used == 0 and target[0].load().kv_blocks_used == 0
    await stop(source, target)


async def test_import_work_runs_off_the_event_loop(tiny, monkeypatch):
    source, target = await started(tiny, "src"), await started(tiny, "dst", block_size=4)
    loop_thread = threading.current_thread()
    threads: list[tuple[str, threading.Thread]] = []
    receive_layers = kv_tcp_data.receive_layers

    def recording_receive_layers(*args, **kwargs):
        threads.append(("receive", threading.current_thread()))
        return receive_layers(*args, **kwargs)

    monkeypatch.setattr(kv_tcp_data, "receive_layers", recording_receive_layers)
    channel = await source[0].add_request("m", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    await wait_tokens(channel, 3)
    stats = await migrate_out(source[0], "m", data_socket_send(target[0]))
    assert stats.total_bytes > 0 and [kind for kind, _ in threads] == ["receive"]
    assert all(thread is not loop_thread for _, thread in threads)
    await stop(source, target)
