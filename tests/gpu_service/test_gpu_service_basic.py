"""gpu_service as a real process: streamed greedy output equals `dualpace generate`."""

from __future__ import annotations

import grpc
import pytest

from dualpace.generation import OfflineGenerator
from dualpace.model.loader import load_model
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.wire.common import finish_reason_from_pb
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2, engine_pb2_grpc
from toolkit.processes import start_daemon


@pytest.fixture(scope="module")
def gpu(synth_checkpoint):
    folder = str(synth_checkpoint("tiny-llama"))
    daemon = start_daemon("gpu_service", "--model", folder, "--dtype", "fp32", "--threads", "1",
                          "--kv-blocks", "128", "--block-size", "8")
    yield folder, daemon
    assert daemon.stop() == 0, daemon.log()


def test_streamed_greedy_equals_generate(gpu):
    folder, daemon = gpu
    loaded = load_model(folder, dtype="fp32")
    prompt = [5, 9, 2, 11, 40]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with grpc.insecure_channel(daemon.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        tokens, reasons = [], []
        for response in stub.Generate(new_request_to_pb("a", prompt, params), timeout=60):
            assert response.first_token_index == len(tokens)
            tokens.extend(response.token_ids)
            reasons.append(finish_reason_from_pb(response.finish_reason))
        load = stub.GetLoad(engine_pb2.GetLoadRequest())
    assert tokens == OfflineGenerator(loaded).generate([prompt], [params])[0].output_token_ids
    assert reasons[-1] == FinishReason.LENGTH and all(r is None for r in reasons[:-1])
    assert load.kv_blocks_used == 0 and load.kv_blocks_total == 128
