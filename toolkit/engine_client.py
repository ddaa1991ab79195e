"""The tools' synchronous Engine client (benchmarks and system tests): generate, resume, abort,
migrate, load. Replies are the protobuf messages; read streams with read_until."""

from __future__ import annotations

import time

import grpc

from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.engine_messages import (
    abort_request_to_pb,
    engine_view_from_pb,
    generate_update_from_pb,
    new_request_to_pb,
    resume_request_to_pb,
)
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc


class EngineClient:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def stream(self, request_id: str, prompt: list[int], params: SamplingParams, timeout_s: float = 120):
        return self.stub.Generate(new_request_to_pb(request_id, prompt, params), timeout=timeout_s)

    def resume(self, request_id: str, from_token_index: int, timeout_s: float = 120):
        return self.stub.Generate(resume_request_to_pb(request_id, from_token_index), timeout=timeout_s)

    def abort(self, request_id: str, timeout_s: float = 10):
        return self.stub.Abort(abort_request_to_pb(request_id), timeout=timeout_s)

    def migrate(self, request_id: str, target_address: str):
        return self.stub.MigrateOut(engine_pb2.MigrateOutRequest(request_id=request_id,
                                                                 target_address=target_address), timeout=60)

    def load(self, timeout_s: float = 10):
        return self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout_s)

    def wait_idle(self, timeout_s: float = 10.0):
        """The load once nothing runs or waits (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = self.load()
            if (load.num_running == 0 and load.num_waiting == 0) or time.monotonic() > deadline:
                return load
            time.sleep(0.05)


def read_until(responses, tokens: list[int], stop_after_tokens: int | None = None):
    """Append streamed tokens to `tokens` (checking there is no gap or repeat); return the
    last update: a finish, a migration, or None when stopped after `stop_after_tokens`."""
    for response in responses:
        update = generate_update_from_pb(response)
        assert update.first_token_index == len(tokens), (update.first_token_index, len(tokens))
        tokens.extend(update.new_token_ids)
        if update.finish_reason is not None or update.migrated_to is not None:
            return update
        if stop_after_tokens is not None and len(tokens) >= stop_after_tokens:
            return None
    raise AssertionError("stream ended without a finish or a migration")


def finish_reason(update) -> FinishReason | None:
    return None if update is None else update.finish_reason


def snapshot_preemptions(address: str, timeout_s: float = 5.0) -> int | None:
    """An engine's preemptions so far, from its load snapshot (GetLoad); None if it does not answer."""
    client = EngineClient(address)
    try:
        return engine_view_from_pb(client.load(timeout_s=timeout_s), "gpu").num_preemptions
    except grpc.RpcError:
        return None
    finally:
        client.close()
