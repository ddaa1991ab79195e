"""KV transfers interrupted at 50%, with a corrupt layer, with a layer missing.

The model here is tiny-qwen2: two layers, so "cut after 1 layer" is exactly half of a transfer.
Each fault has its own source gpu_service (DUALPACE_FAULT_KV_CUT_AFTER_LAYERS=1,
_CORRUPT_LAYER=1, _DROP_LAYER=0; dualpace.faults says what each does on each data path) and they
all migrate to one target, through shared memory (the pools are in host memory on one host).

Criteria: MigrateOut fails (UNAVAILABLE), the target frees whatever it reserved for the
partial import and does not hold the request, the source keeps the request and it completes
exactly as its solo run; afterwards both engines hold zero KV blocks. A hand-made source
also shows the target's reserved blocks once the header is accepted, and their release when
the stream dies or a message out of turn is rejected.
"""

from __future__ import annotations

import grpc
import pytest

from dualpace.sampling import FinishReason
from dualpace.wire.v1 import engine_pb2
from tests.reliability.conftest import (
    EngineProbe,
    EngineStream,
    assert_clean_exit,
    prompt_for,
    start_all,
    start_gpu,
)
from tests.helpers import wait_for
from tests.reliability.kv_transfers import ImportCall, kv_header

NUM_LAYERS = 2
FAULTS = {
    "cut-at-50%": {"DUALPACE_FAULT_KV_CUT_AFTER_LAYERS": "1"},
    "corrupt-layer": {"DUALPACE_FAULT_KV_CORRUPT_LAYER": "1"},
    "layer-missing": {"DUALPACE_FAULT_KV_DROP_LAYER": "0"},
}
STEP_DELAY_MS = 5  # the request is still decoding when MigrateOut reaches it
PROMPT = prompt_for(3, 30)
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def qwen_folder(synth_checkpoint) -> str:
    return str(synth_checkpoint("tiny-qwen2"))


@pytest.fixture(scope="module")
def engines(qwen_folder):
    starters = {
        name: (lambda name=name, env=env: start_gpu(qwen_folder, "--name", f"src-{name}", "--block-size", "8",
                                                    "--kv-blocks", "128", step_delay_ms=STEP_DELAY_MS, env=env))
        for name, env in FAULTS.items()
    }
    starters["target"] = lambda: start_gpu(qwen_folder, "--name", "kv-target", "--block-size", "16",
                                           "--kv-blocks", "64")
    daemons = start_all(**starters)
    probes = {name: EngineProbe(daemon.address) for name, daemon in daemons.items()}
    try:
        yield daemons, probes
    finally:
        for probe in probes.values():
            probe.close()
        assert_clean_exit(daemons.values())


@pytest.mark.parametrize("fault", list(FAULTS))
def test_failed_transfer_keeps_the_request_on_the_source(engines, reference, qwen_folder, fault):
    daemons, probes = engines
    source, target = probes[fault], probes["target"]
    assert source.info().num_layers == NUM_LAYERS
    request_id = f"moving-{fault}"
    stream = EngineStream.run(source.stub, request_id, PROMPT, MAX_TOKENS)
    try:
        assert stream.wait_tokens(1), stream.error
        with pytest.raises(grpc.RpcError) as failed:
            source.stub.MigrateOut(engine_pb2.MigrateOutRequest(request_id=request_id,
                                                                target_address=daemons["target"].address),
                                   timeout=60)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, \
            f"{failed.value}\n{daemons[fault].log()[-3000:]}"
        assert not stream.done.is_set(), "the request finished before the transfer failed"
        # The target dropped the partial import at once; the source still runs the request.
        assert wait_for(target.blocks_used, lambda used: used == 0, timeout_s=5) == 0
        assert request_id not in target.requests()
        held = source.requests()
        assert request_id in held and held[request_id].kv_blocks > 0
        assert stream.wait()
    finally:
        if not stream.done.is_set():
            stream.cancel()
    assert stream.error is None, stream.error
    assert not stream.problems and not stream.migrated_to
    assert stream.finish_reason == FinishReason.LENGTH
    assert stream.tokens == reference(PROMPT, MAX_TOKENS, folder=qwen_folder)
    for probe in (source, target):
        load = probe.wait_idle()
        assert (load.kv_blocks_used, load.num_running, load.num_waiting) == (0, 0, 0)
        assert probe.requests() == {}


@pytest.mark.parametrize("how", ["stream cut after the header", "prepare before the KV", "written without a data socket"])
def test_partial_import_blocks_are_freed_on_the_target(engines, how):
    _, probes = engines
    target = probes["target"]
    info = target.info()
    outputs = [7, 8, 9]
    num_computed = len(PROMPT) + len(outputs) - 1
    request_id = f"partial-{how.replace(' ', '-')}"
    call = ImportCall(target.stub)
    try:
        call.send(kv_header(request_id, PROMPT, outputs, 64, info))
        # Reserved for the whole transfer as soon as the header was accepted.
        expected_blocks = -(-num_computed // info.block_size)
        assert wait_for(target.blocks_used, lambda used: used > 0, timeout_s=5) == expected_blocks
        if how == "stream cut after the header":
            call.cancel()
        elif how == "prepare before the KV":
            call.send(engine_pb2.ImportKvMessage(prepare=engine_pb2.ImportKvPrepare()))
        else:  # the header offered no data socket, so no KV can have been written through one
            written = engine_pb2.KvTcpWritten(layer_crc32=[0] * info.num_layers, commit=True)
            call.send(engine_pb2.ImportKvMessage(tcp_written=written))
        assert call.done.wait(30)
    finally:
        call.cancel()
    if how == "stream cut after the header":
        assert call.error.code() == grpc.StatusCode.CANCELLED
    else:
        assert call.error.code() == grpc.StatusCode.INVALID_ARGUMENT, call.error
        assert ("prepare" if how == "prepare before the KV" else "tcp_written") in call.error.details()
    assert not call.replies
    assert wait_for(target.blocks_used, lambda used: used == 0, timeout_s=5) == 0
    assert request_id not in target.requests()
    target.assert_serving_and_generates(f"after-{request_id}")
