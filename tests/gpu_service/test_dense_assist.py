"""GPU Dense Assist over real gRPC: the executor and servicer in a background server, the sync client.

The client keeps its own paged KV (prefilled in-process) and computes decode
attention there; the assisted logits must equal an in-process PagedForward step.
Each client test runs on both transports: "shm" (the per-layer tensors through the stream's
shared-memory rings, checked to have been used) and "tcp" (the same messages as frames on the
server's TCP data socket, as between hosts).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from cpu_service.assist_client import AssistClient, AssistUnavailable
from dualpace.engine.assist import assist_types
from dualpace.engine.transfer.kv_tcp_import import TcpDataServer
from dualpace.errors import InvalidArgument
from dualpace.kv.storage import KVStorage
from dualpace.model.attention import decode_attention
from dualpace.model.loader import LoadedModel, load_model
from dualpace.model.paged_forward import PagedForward, SequenceWork
from dualpace.sampling import SamplingParams, sample_next_tokens
from dualpace.wire import assist_messages, common
from dualpace.wire.v1 import assist_pb2, assist_pb2_grpc
from gpu_service.assist_servicer import add_dense_assist_servicer
from gpu_service.dense_assist import DenseAssistExecutor

BLOCK_SIZE = 4
HANG_GUARD_S = 60.0  # the longest a client waits for a reply here: a hang guard, never a criterion
PROMPT_LENGTHS = (3, 9, 17)
TRANSPORTS = {"shm": "auto", "tcp": "tcp"}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request) -> str:
    """The client's --assist-transport for one run of a test ("auto" finds the same host here)."""
    return TRANSPORTS[request.param]


def assert_used(client: AssistClient, transport: str, num_iterations: int) -> None:
    """The iterations ran through shared memory, or through the data socket with transport tcp."""
    assert client.num_shm_iterations == num_iterations
    assert client.data_path == {"auto": "shm", "tcp": "tcp"}[transport]


class _CountingExecutor(DenseAssistExecutor):
    """Counts sessions, i.e. streams opened."""

    num_sessions = 0

    def new_session(self):
        self.num_sessions += 1
        return super().new_session()


class _ServerThread:
    """A grpc.aio server with the DenseAssist servicer, on its own event loop in a thread."""

    def __init__(self, executor: DenseAssistExecutor):
        self.executor = executor
        self.limits = None  # AssistLimits for the servicer; None: its defaults
        self.data_socket = None  # the TcpDataServer it serves assist frames on (as gpu_service's KV one)
        self.data_tls = None  # that socket's ssl.SSLContext (None: plaintext)
        self.port = 0
        self._started = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop_event: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        server = grpc.aio.server()
        self.data_socket = await TcpDataServer.start("127.0.0.1", self.data_tls)
        add_dense_assist_servicer(self.executor, server, self.limits, self.data_socket)
        self.port = server.add_insecure_port("127.0.0.1:0")
        self._stop_event = asyncio.Event()
        await server.start()
        self._started.set()
        await self._stop_event.wait()
        await server.stop(grace=None)
        await self.data_socket.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> _ServerThread:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop_event.set)
            self._thread.join(10)


@pytest.fixture(scope="module")
def loaded(synth_checkpoint) -> LoadedModel:
    return load_model(str(synth_checkpoint("tiny-llama")), dtype="fp32")


@pytest.fixture
def server(loaded) -> Iterator[_ServerThread]:
    running = _ServerThread(_CountingExecutor(loaded.model)).start()
    yield running
    running.stop()


class _HostSide:
    """What the CPU engine holds: paged KV for a batch of sequences and their block tables."""

    def __init__(self, loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int):
        cfg = loaded.config
        max_blocks = -(-(max(map(len, prompts)) + max_new_tokens) // BLOCK_SIZE)
        self.kv = KVStorage(cfg.num_layers, len(prompts) * max_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                            loaded.model.dtype)
        self.block_tables = [list(range(i * max_blocks, (i + 1) * max_blocks)) for i in range(len(prompts))]
        self.lengths = [len(p) for p in prompts]
        self.scale = cfg.head_dim**-0.5

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this step's k, v (one token per row at position length - 1) and attend."""
        slots = [table[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                 for table, n in zip(self.block_tables, self.lengths)]
        self.kv.write(layer, torch.tensor(slots), k, v)
        tables = torch.tensor(self.block_tables)
        lens = torch.tensor(self.lengths)
        return decode_attention(q, self.kv.k[layer], self.kv.v[layer], tables, lens, self.scale)


def _prefilled(loaded: LoadedModel, max_new_tokens: int) -> tuple[_HostSide, PagedForward, list[int]]:
    """Host KV prefilled with three prompts of different lengths, a reference copy, first tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab_size = loaded.config.vocab_size
    prompts = [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    host = _HostSide(loaded, prompts, max_new_tokens)
    work = [SequenceWork(p, 0, t) for p, t in zip(prompts, host.block_tables)]
    logits = PagedForward(loaded.model, host.kv).forward(work)
    reference_kv = KVStorage(host.kv.num_layers, host.kv.num_blocks, BLOCK_SIZE, host.kv.num_kv_heads,
                             host.kv.head_dim, host.kv.dtype)
    reference_kv.k.copy_(host.kv.k)
    reference_kv.v.copy_(host.kv.v)
    return host, PagedForward(loaded.model, reference_kv), logits.argmax(dim=1).tolist()


def _reference_step(reference: PagedForward, host: _HostSide, token_ids: list[int]) -> torch.Tensor:
    positions = [n - 1 for n in host.lengths]
    return reference.forward(
        [SequenceWork([t], p, table) for t, p, table in zip(token_ids, positions, host.block_tables)]
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_assisted_decode_matches_in_process_forward(loaded, synth_checkpoint, device, transport) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    server_model = loaded.model if device == "cpu" else load_model(
        str(synth_checkpoint("tiny-llama")), dtype="fp32", device=device).model
    tolerance = 1e-5 if device == "cpu" else 1e-4
    running = _ServerThread(_CountingExecutor(server_model)).start()
    num_logit_steps, num_sampled_steps = 3, 2
    host, reference, token_ids = _prefilled(loaded, num_logit_steps + num_sampled_steps)
    try:
        with AssistClient(running.address, iteration_timeout_s=10.0, transport=transport) as client:
            for _ in range(num_logit_steps):
                host.lengths = [n + 1 for n in host.lengths]
                positions = [n - 1 for n in host.lengths]
                logits = client.run_iteration(token_ids, positions, host.attend)
                expected = _reference_step(reference, host, token_ids)
                assert logits.dtype == torch.float32 and logits.shape == expected.shape
                assert (logits - expected).abs().max().item() < tolerance
                token_ids = expected.argmax(dim=1).tolist()
            # Sampling on the server: greedy rows take the argmax, a seeded row draws what the
            # in-process sampler draws for the same (seed, position + 1).
            sampling = [(SamplingParams(), 11), (SamplingParams(temperature=0.8, top_k=50), 12), (SamplingParams(), 13)]
            for _ in range(num_sampled_steps):
                host.lengths = [n + 1 for n in host.lengths]
                positions = [n - 1 for n in host.lengths]
                sampled = client.run_iteration(token_ids, positions, host.attend, sampling)
                expected = _reference_step(reference, host, token_ids)
                want = sample_next_tokens(expected, [p for p, _ in sampling], [s for _, s in sampling],
                                          [p + 1 for p in positions])
                assert sampled == want.token_ids
                argmax = expected.argmax(dim=1).tolist()
                assert sampled[0] == argmax[0] and sampled[2] == argmax[2]
                token_ids = sampled
            assert_used(client, transport, num_logit_steps + num_sampled_steps)
        assert running.executor.num_sessions == 1  # every iteration ran over one stream
    finally:
        running.stop()


def _zeros_attend(loaded: LoadedModel):
    width = loaded.config.num_heads * loaded.config.head_dim

    def attend(layer, q, k, v):
        return torch.zeros(q.shape[0], width)

    return attend


def test_server_stopped_mid_iteration_raises_unavailable(loaded, server, transport) -> None:
    """The stream's end is noticed as such, not by waiting out the client's iteration timeout
    (a hang guard here: the error names the end of the stream, not a missing reply)."""
    client = AssistClient(server.address, iteration_timeout_s=HANG_GUARD_S, transport=transport)

    def attend(layer, q, k, v):
        if layer == 1:
            server.stop()
        return _zeros_attend(loaded)(layer, q, k, v)

    with pytest.raises(AssistUnavailable) as raised:
        client.run_iteration([1, 2], [0, 0], attend)
    assert "no reply" not in str(raised.value), raised.value
    assert client.consecutive_failures == 1
    with pytest.raises(AssistUnavailable):  # still down: reopening fails cleanly
        client.run_iteration([1, 2], [0, 0], _zeros_attend(loaded))
    client.close()


def test_busy_server_times_out_then_recovers(loaded, server, transport) -> None:
    """The GPU engine holding the device lock past the timeout: unavailable, then a fresh stream works."""
    client = AssistClient(server.address, iteration_timeout_s=0.3, transport=transport)
    attend = _zeros_attend(loaded)
    client.run_iteration([1], [0], attend)
    assert_used(client, transport, 1)
    with server.executor.device_lock:
        with pytest.raises(AssistUnavailable, match="no reply"):  # the client's own timeout, not a server error
            client.run_iteration([1], [0], attend)
    logits = client.run_iteration([1, 2], [0, 3], attend)
    assert logits.shape == (2, loaded.config.vocab_size)
    assert client.consecutive_failures == 0
    assert_used(client, transport, 2)
    client.close()


def test_unreachable_server_raises_unavailable(transport) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = AssistClient(f"127.0.0.1:{port}", iteration_timeout_s=5.0, transport=transport)
    with pytest.raises(AssistUnavailable) as raised:
        client.run_iteration([1], [0], lambda layer, q, k, v: q.reshape(1, -1))
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    client.close()


def _begin(iteration_id: int, num_rows: int = 2, sampling=None) -> assist_types.AssistBegin:
    return assist_types.AssistBegin(iteration_id, [1] * num_rows, [0] * num_rows, sampling)


def _stream_status(address: str, messages: list[assist_pb2.AssistUp]) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        call = assist_pb2_grpc.DenseAssistStub(channel).Assist(iter(messages), timeout=10)
        with pytest.raises(grpc.RpcError) as raised:
            for _ in call:
                pass
        return raised.value.code(), raised.value.details()


def test_the_stream_takes_only_the_offer(loaded, server) -> None:
    """A begin on the gRPC stream (the iteration's messages go through the rings or the data socket),
    an empty message, or a second offer ends the stream with INVALID_ARGUMENT naming the field; the
    server still serves new streams."""
    offer = assist_messages.assist_up_to_pb(assist_types.AssistShmOffer("", "", 1 << 20, b"", tcp=True))
    cases = {
        "begin": [assist_messages.assist_up_to_pb(_begin(1))],
        "kind": [assist_pb2.AssistUp()],
        "shm_offer": [offer, offer],
    }
    for expected_field, messages in cases.items():
        code, details = _stream_status(server.address, messages)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (expected_field, details)
        assert details.startswith(expected_field), (expected_field, details)
    with AssistClient(server.address) as client:
        assert client.run_iteration([1], [0], _zeros_attend(loaded)).shape == (1, loaded.config.vocab_size)


def test_bad_begins_and_attention_outputs_are_refused_naming_the_field(loaded) -> None:
    """What the ring thread hands the session: each malformed message raises InvalidArgument
    naming its field (the stream then ends with INVALID_ARGUMENT), and the wire refuses a begin
    whose sampling row has no seed."""
    width = loaded.config.num_heads * loaded.config.head_dim
    executor = DenseAssistExecutor(loaded.model)

    def output(iteration_id: int, layer: int, num_columns: int = width) -> assist_types.AssistAttentionOutput:
        return assist_types.AssistAttentionOutput(iteration_id, layer, torch.zeros(2, num_columns))

    def whole_iteration_5(session) -> None:
        session.begin(_begin(5))
        for layer in range(loaded.config.num_layers):
            session.attention_output(output(5, layer))

    cases = {
        "attention_output: no iteration": [lambda s: s.attention_output(output(1, 0))],
        "attention_output.layer": [lambda s: s.begin(_begin(1)), lambda s: s.attention_output(output(1, 1))],
        "attention_output.attention_output": [lambda s: s.begin(_begin(1)),
                                              lambda s: s.attention_output(output(1, 0, width + 1))],
        "attention_output.iteration_id": [lambda s: s.begin(_begin(1)), lambda s: s.attention_output(output(2, 0))],
        "begin: iteration 1 is still in progress": [lambda s: s.begin(_begin(1)), lambda s: s.begin(_begin(2))],
        "begin.iteration_id": [whole_iteration_5, lambda s: s.begin(_begin(5))],
        "begin.sampling[1].top_p": [lambda s: s.begin(_begin(1, sampling=[(SamplingParams(), 1),
                                                                           (SamplingParams(top_p=0.0), 2)]))],
        "begin.token_ids[0]": [lambda s: s.begin(assist_types.AssistBegin(1, [loaded.config.vocab_size], [0], None))],
    }
    for expected_field, steps in cases.items():
        session = executor.new_session()
        try:
            *before, last = steps
            for step in before:
                step(session)
            with pytest.raises(InvalidArgument) as raised:
                last(session)
            assert str(raised.value).startswith(expected_field), (expected_field, str(raised.value))
        finally:
            session.close()
    no_seed = assist_pb2.AssistUp(begin=assist_pb2.AssistBegin(
        iteration_id=1, token_ids=[1], positions=[0], sampling=[common.sampling_params_to_pb(SamplingParams())]))
    with pytest.raises(ValueError, match=r"^begin.sampling\[0\].seed"):
        assist_messages.assist_up_from_pb(no_seed)


def test_device_wait_budget_ends_the_iteration_with_resource_exhausted(loaded, server, transport) -> None:
    """The GPU engine takes the device while the CPU computes attention and keeps it past the
    iteration's max_device_wait_ms: RESOURCE_EXHAUSTED (the CPU engine redoes it locally)."""
    client = AssistClient(server.address, iteration_timeout_s=HANG_GUARD_S, transport=transport)
    lock = server.executor.device_lock
    zeros = _zeros_attend(loaded)

    def attend(layer, q, k, v):
        if layer == 0:
            lock.acquire()  # between two stages the device is free: the engine takes it, until the test frees it
        return zeros(layer, q, k, v)

    try:
        with pytest.raises(AssistUnavailable) as raised:
            client.run_iteration([1], [0], attend, max_device_wait_ms=200)
        assert lock.locked()  # the iteration gave up while the engine still held the device
    finally:
        lock.release()
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.run_iteration([1], [0], zeros).shape == (1, loaded.config.vocab_size)
    assert_used(client, transport, 1)
    client.close()
