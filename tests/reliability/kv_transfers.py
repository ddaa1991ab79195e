"""Hand-made KV transfers: the header a source would send, and an ImportKv call fed message by
message from the test."""

from __future__ import annotations

import queue
import threading

import grpc

from dualpace.wire.v1 import common_pb2, engine_pb2, engine_pb2_grpc


def kv_header(request_id: str, prompt: list[int], outputs: list[int], max_tokens: int, info: engine_pb2.EngineInfo,
              dtype: str = "float32", with_kv: bool = True) -> engine_pb2.ImportKvMessage:
    """The header of a transfer carrying the KV of every token but the last sampled one (what a
    source would send), for the engine described by `info`; with_kv=False: a request moved without
    KV (the target recomputes it)."""
    num_computed = len(prompt) + len(outputs) - 1 if with_kv else 0
    layer_bytes = 2 * num_computed * info.num_kv_heads * info.head_dim * DTYPE_SIZES[dtype]
    return engine_pb2.ImportKvMessage(header=engine_pb2.ImportKvHeader(
        request_id=request_id, prompt_token_ids=prompt, output_token_ids=outputs,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7),
        num_computed_tokens=num_computed, num_tokens_emitted=len(outputs),
        layout=engine_pb2.KvLayout(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                                   head_dim=info.head_dim, block_size=info.block_size, dtype=dtype),
        total_bytes=layer_bytes * info.num_layers,
        source_engine="test"))


DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ImportCall:
    """An ImportKv stream fed message by message from the test (a hand-made source)."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub, timeout_s: float = 60.0):
        self._queue: queue.Queue = queue.Queue()
        self.call = stub.ImportKv(iter(self._queue.get, None), timeout=timeout_s)
        self.replies: list[engine_pb2.ImportKvReply] = []
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.append(reply)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()

    def send(self, *messages: engine_pb2.ImportKvMessage) -> None:
        for message in messages:
            self._queue.put(message)

    def close(self) -> None:
        """End the client side (the source finished sending)."""
        self._queue.put(None)

    def cancel(self) -> None:
        self.call.cancel()
        self._queue.put(None)
