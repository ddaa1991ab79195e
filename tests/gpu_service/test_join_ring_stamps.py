"""A joined iteration through a real ring (gpu_service/join_channel.py's RingJoinChannel against
cpu_service/assist_shm.py's ShmIterations, dualpace/engine/assist/ring_pacing.py): the GPU side stamps
the CPU side stamps its answers; the answers are the CPU's, and the channel's marks count each
layer with times that add up."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cpu_service.assist_shm import ShmIterations
from dualpace.engine.assist.assist_types import AssistBegin, AssistResult, AssistShmAnswer
from dualpace.engine.assist.shm_doorbell import SUPPORTED
from dualpace.engine.assist.shm_ring import ShmSegment
from gpu_service.join_channel import RingJoinChannel, send_result


class _Model:  # what RingJoinChannel reads of a model
    class config:
        num_heads, num_kv_heads, head_dim = 2, 1, 4
    device, dtype = torch.device("cpu"), torch.float32


@pytest.mark.skipif(not SUPPORTED, reason="shared memory needs Linux x86-64")
def test_a_joined_layer_through_the_ring_is_stamped_both_ways():
    client_segment = ShmSegment.create(2, 64 * 1024)
    server_segment = ShmSegment.open(client_segment.peer_path, client_segment.size_bytes, client_segment.client_token)
    rings = ShmIterations(client_segment, AssistShmAnswer(accepted=True, max_batch_rows=8), 0.0)
    server = server_segment.endpoint("down", 0.0)
    begin = AssistBegin(iteration_id=7, token_ids=[1, 2], positions=[3, 4], sampling=None)
    num_layers, done = 5, {}

    def cpu() -> None:
        done["result"] = rings.run(begin, b"begin", lambda layer, q, k, v: q.reshape(2, 8) + layer,
                                   time.monotonic() + 30, lambda: False, None)

    thread = threading.Thread(target=cpu)
    thread.start()
    try:
        assert server.receive(time.monotonic() + 30).payload == b"begin"
        channel = RingJoinChannel(server, _Model, begin, lambda: False, lambda pb: None)
        for layer in range(num_layers):
            q = torch.full((2, 2, 4), float(layer))
            channel.send_qkv(layer, q, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
            out = channel.receive_attention(layer, time.monotonic() + 30)
            assert torch.equal(out, q.reshape(2, 8) + layer)
        send_result(server, AssistResult(7, token_ids=[5, 6]), lambda pb: None)
        thread.join(30)
        assert done["result"].token_ids == [5, 6]
        marks = channel.marks
        assert marks.num_layers == num_layers and marks.cpu_layer_ns >= 0 and marks.down_hop_ns > 0
        assert marks.wait_before_answer_ns + marks.up_hop_ns > 0
    finally:
        thread.join(30)
        rings.close()
        server_segment.close()
