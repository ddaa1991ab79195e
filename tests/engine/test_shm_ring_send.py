"""The ring's per-layer send path (dualpace/engine/assist/shm_ring.py send_parts): what arrives equals what
was sent whether the tensor is copied by memmove (contiguous, CPU) or by copy_ (strided), and a slot
whose layout changes (another batch, another dtype) carries the new shapes, also when it goes back."""

from __future__ import annotations

import pytest
import torch

from dualpace.engine.assist.shm_doorbell import SUPPORTED
from dualpace.engine.assist.shm_ring import ShmSegment, SlotMessage

pytestmark = pytest.mark.skipif(not SUPPORTED, reason="shared memory needs Linux x86-64")


@pytest.fixture
def ends():
    client_segment = ShmSegment.create(2, 64 * 1024)
    server_segment = ShmSegment.open(client_segment.peer_path, client_segment.size_bytes, client_segment.client_token)
    yield client_segment.endpoint("up", 0.0), server_segment.endpoint("down", 0.0)
    client_segment.close()
    server_segment.close()


def test_contiguous_and_strided_tensors_arrive_equal(ends):
    client, server = ends
    q = torch.randn(4, 9, 8).to(torch.bfloat16)
    strided_k = torch.randn(8, 3, 4).transpose(0, 2)  # [4, 3, 8], not contiguous
    assert not strided_k.is_contiguous()
    server.send_parts(5, 11, 2, (q, strided_k), b"tail")
    message = client.receive(None)
    assert (message.kind, message.iteration_id, message.layer, message.payload) == (5, 11, 2, b"tail")
    assert torch.equal(message.tensors[0], q) and torch.equal(message.tensors[1], strided_k)


def test_a_slot_whose_layout_changes_carries_the_new_shapes(ends):
    client, server = ends
    # two slots: messages 0, 2, 4 share slot 0 and alternate layouts there
    batches = [(3, torch.float32), (1, torch.float32), (5, torch.float16), (1, torch.float32), (3, torch.float32)]
    for number, (batch, dtype) in enumerate(batches):
        tensor = torch.arange(batch * 6, dtype=torch.float32).reshape(batch, 2, 3).to(dtype) + number
        server.send(SlotMessage(1, number, 0, [tensor]))
        (received,) = client.receive(None).tensors
        assert received.dtype == dtype and received.shape == tensor.shape and torch.equal(received, tensor)
