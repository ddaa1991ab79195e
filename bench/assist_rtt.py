"""Dense Assist round trip per layer, through shared memory, over the TCP data socket and over gRPC.

    python -m bench.assist_rtt                      # default model's shapes, batch 1, 8, 32, shm and tcp
    python -m bench.assist_rtt --batch 8 --iterations 50 --out rtt.json
    python -m bench.assist_rtt --transport tcp --transport shm --transport tcp --transport shm  # alternated

What is timed is the transport alone: a gpu_service-side process (a subprocess running the real
DenseAssist servicer, with sessions that answer every stage at once with q/k/v of the model's
shapes, no device work) and the real AssistClient here, whose attention callback returns at
once. A layer's round trip is the time from the callback returning layer l's attention output
to the callback being called with layer l + 1's q/k/v: the client writes the output, the server
wakes, reads it and writes the next q/k/v, the client wakes and reads them. p50/p99 over every
layer of every timed iteration. `measure()` is what bench/data_plane.py imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dualpace.engine.assist.assist_types import AssistAttentionOutput, AssistBegin, AssistQkv, AssistResult
from dualpace.model.loader import load_tokenizer_and_config
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams
from dualpace.stats import percentile

TRANSPORTS = {"shm": "auto", "tcp": "tcp"}  # bench name -> the client's --assist-transport
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_BATCH_SIZES = (1, 8, 32)
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Shapes:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, model: str) -> Shapes:
        _, config = load_tokenizer_and_config(model)
        return cls(config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size)


class InstantSession:
    """Answers like an AssistSession, with no device work: each stage returns prepared q/k/v."""

    def __init__(self, shapes: Shapes, dtype: torch.dtype):
        self._shapes = shapes
        self._dtype = dtype
        self._begin: AssistBegin | None = None
        self._next_layer = 0
        self._qkv: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def in_iteration(self) -> bool:
        return self._begin is not None

    @property
    def accepts_join(self) -> bool:
        return False  # the round trip measured is the staged exchange's

    def begin(self, begin: AssistBegin, channel=None) -> AssistQkv:
        self._begin, self._next_layer = begin, 0
        return self._layer_qkv(0)

    def attention_output(self, message: AssistAttentionOutput) -> AssistQkv | AssistResult:
        begin = self._begin
        if begin is None or message.layer != self._next_layer or message.attention_output.shape[0] != len(begin.token_ids):
            raise ValueError(f"attention_output: layer {message.layer} out of turn")
        if message.layer + 1 < self._shapes.num_layers:
            self._next_layer += 1
            return self._layer_qkv(self._next_layer)
        self._begin = None
        return AssistResult(begin.iteration_id, token_ids=[1] * len(begin.token_ids))

    def _layer_qkv(self, layer: int) -> AssistQkv:
        batch = len(self._begin.token_ids)
        if batch not in self._qkv:
            s = self._shapes
            self._qkv[batch] = tuple(torch.randn(batch, heads, s.head_dim).to(self._dtype)
                                     for heads in (s.num_heads, s.num_kv_heads, s.num_kv_heads))
        return AssistQkv(self._begin.iteration_id, layer, *self._qkv[batch])

    def close(self) -> None:
        self._begin = None


class InstantExecutor:
    def __init__(self, shapes: Shapes, dtype: torch.dtype):
        self.model = SimpleNamespace(config=shapes, dtype=dtype)  # what the shm offer's row count reads
        self._shapes, self._dtype = shapes, dtype

    def new_session(self) -> InstantSession:
        return InstantSession(self._shapes, self._dtype)


async def _serve(shapes: Shapes, dtype: torch.dtype) -> None:
    import grpc

    from gpu_service.assist_limits import AssistLimits
    from dualpace.engine.transfer.kv_tcp_import import TcpDataServer
    from gpu_service.assist_servicer import add_dense_assist_servicer

    server = grpc.aio.server()
    data_socket = await TcpDataServer.start("127.0.0.1")  # as gpu_service's (its KV data socket)
    add_dense_assist_servicer(InstantExecutor(shapes, dtype), server, AssistLimits(), data_socket)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    await server.stop(grace=None)
    await data_socket.close()


def _start_server(model: str, dtype_name: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "bench.assist_rtt", "--serve", "--model", model,
                                "--dtype", dtype_name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline().strip()
    if not line.isdigit():
        process.kill()
        raise RuntimeError(f"the assist server did not start (said {line!r})")
    return process, f"127.0.0.1:{line}"


def measure(transport: str, batch_sizes=DEFAULT_BATCH_SIZES, model: str = DEFAULT_MODEL_NAME,
            dtype: str = "bf16", num_iterations: int = 30, num_warmup: int = 5) -> dict:
    """Round trip per layer (µs) at each batch size over `transport` ("shm" or "tcp")."""
    from cpu_service.assist_client import AssistClient
    from cpu_service.assist_shm import slot_bytes_for

    if transport not in TRANSPORTS:
        raise ValueError(f"transport: {transport!r}; use one of {sorted(TRANSPORTS)}")
    shapes = Shapes.of(model)
    process, address = _start_server(model, dtype)
    slot_bytes = slot_bytes_for(max(batch_sizes), shapes.num_heads, shapes.num_kv_heads, shapes.head_dim)
    client = AssistClient(address, iteration_timeout_s=60.0, transport=TRANSPORTS[transport], shm_slot_bytes=slot_bytes)
    results: dict[str, dict] = {}
    try:
        for batch in batch_sizes:
            output = torch.zeros(batch, shapes.num_heads * shapes.head_dim, dtype=DTYPES[dtype])
            marks: list[tuple[int, float, float]] = []  # layer, called at, returned at

            def attend(layer, q, k, v):
                called_s = time.perf_counter()
                marks.append((layer, called_s, time.perf_counter()))
                return output

            sampling = [(SamplingParams(), row) for row in range(batch)]  # token ids come back, as in serving
            round_trips_us: list[float] = []
            for iteration in range(num_warmup + num_iterations):
                marks.clear()
                client.run_iteration([1] * batch, [7] * batch, attend, sampling)
                if iteration >= num_warmup:
                    round_trips_us += [(marks[i + 1][1] - marks[i][2]) * 1e6 for i in range(len(marks) - 1)]
            results[str(batch)] = {"p50_us": round(percentile(round_trips_us, 50), 1),
                                   "p99_us": round(percentile(round_trips_us, 99), 1),
                                   "num_round_trips": len(round_trips_us)}
        used_shm, data_path = client.num_shm_iterations, client.data_path
    finally:
        client.close()
        process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
    if transport == "shm" and used_shm == 0:
        raise RuntimeError("the server refused shared memory: nothing was measured over shm")
    if transport == "tcp" and (used_shm == 0 or data_path != "tcp"):
        raise RuntimeError("no iteration went over the data socket: nothing was measured over tcp")
    return {"transport": transport, "model": model, "dtype": dtype, "num_layers": shapes.num_layers,
            "batch": results, "cpu": cpu_model(), "load_average_1m": round(os.getloadavg()[0], 2)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"unknown x{os.cpu_count()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.assist_rtt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="whose shapes (layers, heads, head_dim)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="dtype of the tensors that cross")
    parser.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default 1, 8, 32)")
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), action="append",
                        help="repeatable, run in the order given (default: shm, tcp)")
    parser.add_argument("--iterations", type=int, default=30, help="timed iterations per batch size")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(Shapes.of(args.model), DTYPES[args.dtype]))
        return 0
    if args.iterations < 1 or any(b < 1 for b in args.batch or ()):
        parser.error("--iterations and --batch must be >= 1")
    batch_sizes = tuple(args.batch or DEFAULT_BATCH_SIZES)
    runs = [measure(t, batch_sizes, args.model, args.dtype, args.iterations) for t in args.transport or ("shm", "tcp")]
    print(f"Dense Assist round trip per layer, {args.model} shapes, {args.dtype}; {runs[0]['cpu']}; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'transport':>9} {'batch':>5} {'p50 µs':>9} {'p99 µs':>9}")
    for run in runs:
        for batch, row in run["batch"].items():
            print(f"{run['transport']:>9} {batch:>5} {row['p50_us']:>9.1f} {row['p99_us']:>9.1f}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(runs, out, indent=2)
    print(json.dumps({"assist_rtt_us": {r["transport"]: r["batch"] for r in runs}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
