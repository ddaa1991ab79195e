"""One measurement per table, on the real runners and the real daemons' paths.

- whole iterations: `ModelRunner.execute` on a StepPlan (what both engines' step loops run);
- CPU attention: `paged_forward.attend` + the KV write for every layer (what a Local or an
  Assisted iteration runs beside the host KV);
- LM head + sampling: `Transformer.logits` + `sample_next_tokens`;
- GPU dense: the dense stages of every layer + LM head + sampling on the GPU engine's device;
- Dense Assist: `AssistClient.run_iteration` against a real gpu_service over gRPC, with an
  attention callback that returns at once (so the time is the assist part only);
- KV transfer: the migration's senders (shared memory, or the TCP data socket) moving a request's
  KV from the profiler's KV storage into that gpu_service, gRPC ImportKv as the control plane,
  through commit.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
from collections.abc import Callable

import torch

from dualpace.engine.transfer.kv_bytes import DTYPE_NAMES
from dualpace.engine.transfer.kv_source import OutgoingKv
from dualpace.engine.transfer.kv_transfer import KvLayout, KvTransferHeader
from dualpace.engine.runner import ModelRunner
from dualpace.engine.scheduler import ScheduledSequence, StepPlan
from dualpace.model.loader import LoadedModel
from dualpace.model.paged_forward import SequenceWork, attend, build_step_tensors
from dualpace.profile.schema import KVTransfer
from dualpace.sampling import SamplingParams, sample_next_tokens
from profiles.profiler.timing import Sample, summarize

GREEDY = SamplingParams(max_tokens=1 << 20, ignore_eos=True)


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class RunnerBench:
    """Plans and timed closures over one engine runner (one device, one KV pool)."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int):
        self.loaded = loaded
        self.runner = ModelRunner(loaded, num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = loaded.model.device
        self.dtype = loaded.model.dtype
        cfg = loaded.config
        self.config = cfg
        self._generator = torch.Generator().manual_seed(0)

    def _token(self, i: int) -> int:
        return 1 + i % max(1, self.config.vocab_size - 1)

    def decode_plan(self, batch: int, context_tokens: int) -> StepPlan:
        """`batch` sequences, each decoding its token number `context_tokens` (attention over
        context_tokens tokens, the new one included); disjoint block tables."""
        per_sequence = blocks_needed(context_tokens, self.block_size)
        if batch * per_sequence > self.num_blocks:
            raise ValueError(f"{batch} x {context_tokens} tokens need {batch * per_sequence} blocks, "
                             f"the bench has {self.num_blocks}")
        sequences = tuple(
            ScheduledSequence(f"decode-{i}", (self._token(i),), context_tokens - 1,
                              tuple(range(i * per_sequence, (i + 1) * per_sequence)), True, GREEDY, i)
            for i in range(batch))
        return StepPlan(sequences)

    def prefill_plan(self, num_tokens: int) -> StepPlan:
        blocks = tuple(range(blocks_needed(num_tokens, self.block_size)))
        tokens = tuple(self._token(i) for i in range(num_tokens))
        return StepPlan((ScheduledSequence("prefill", tokens, 0, blocks, True, GREEDY, 0),))

    def iteration(self, plan: StepPlan) -> Callable[[], object]:
        return lambda: self.runner.execute(plan)

    def attention(self, batch: int, context_tokens: int) -> Callable[[], object]:
        """Every layer's KV write + decode attention for a decode batch, as an iteration runs them."""
        plan = self.decode_plan(batch, context_tokens)
        work = [SequenceWork(list(s.token_ids), s.start_pos, list(s.block_ids)) for s in plan.sequences]
        step = build_step_tensors(work, self.block_size, self.device)
        cfg = self.config
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=self._generator).to(self.device, self.dtype)
        k = torch.randn(batch, cfg.num_kv_heads, cfg.head_dim, generator=self._generator).to(self.device, self.dtype)
        v = torch.randn_like(k)
        kv = self.runner.kv
        scale = cfg.head_dim**-0.5

        @torch.inference_mode()
        def run() -> None:
            for layer in range(cfg.num_layers):
                kv.write(layer, step.slot_ids, k, v)
                attend(q, layer, step, kv, scale)

        return run

    def _hidden(self, batch: int) -> torch.Tensor:
        return torch.randn(batch, self.config.hidden_size, generator=self._generator).to(self.device, self.dtype)

    def lm_head_sampling(self, batch: int) -> Callable[[], object]:
        hidden = self._hidden(batch)
        model = self.loaded.model
        params, seeds, positions = [GREEDY] * batch, list(range(batch)), [64] * batch

        @torch.inference_mode()
        def run() -> None:
            sample_next_tokens(model.logits(hidden), params, seeds, positions)

        return run

    def dense(self, batch: int) -> Callable[[], object]:
        """What the GPU computes for one assisted iteration: embed, every layer's dense stages,
        LM head and sampling (attention replaced by zeros: it runs on the CPU)."""
        model = self.loaded.model
        cfg = self.config
        token_ids = torch.tensor([self._token(i) for i in range(batch)], device=self.device)
        positions = torch.full((batch,), 63, dtype=torch.long, device=self.device)
        zeros = torch.zeros(batch, cfg.num_heads * cfg.head_dim, dtype=self.dtype, device=self.device)
        params, seeds, sample_positions = [GREEDY] * batch, list(range(batch)), [64] * batch

        @torch.inference_mode()
        def run() -> None:
            hidden = model.embed(token_ids)
            rope = model.rope_angles(positions)
            for layer in range(cfg.num_layers):
                model.pre_attention(layer, hidden, rope)
                hidden = model.post_attention(layer, hidden, zeros)
            sample_next_tokens(model.logits(hidden), params, seeds, sample_positions)

        return run


# ---------------------------------------------------------------------- gpu_service


def start_gpu_service(model: str, dtype: str, device: str, threads: int, kv_blocks: int, block_size: int):
    """A real gpu_service (`python -m gpu_service`) on 127.0.0.1, an ephemeral port; `.stop()` ends it."""
    from toolkit.processes import start_daemon

    return start_daemon("gpu_service", "--model", model, "--dtype", dtype, "--device", device,
                        "--threads", str(threads), "--kv-blocks", str(kv_blocks), "--block-size", str(block_size),
                        "--log-level", "WARNING", env={"PYTHONUNBUFFERED": "1"})


def assist_iteration(client, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                     context_tokens: int = 64) -> Callable[[], object]:
    """One Dense Assist iteration over `batch` rows with an instant attention callback."""
    token_ids = [1 + i for i in range(batch)]
    positions = [context_tokens - 1] * batch
    sampling = [(GREEDY, i) for i in range(batch)]
    zeros = torch.zeros(batch, num_heads * head_dim, dtype=dtype)

    def attend_nothing(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return zeros if q.dtype == zeros.dtype else zeros.to(q.dtype)

    return lambda: client.run_iteration(token_ids, positions, attend_nothing, sampling)


# ---------------------------------------------------------------------- KV transfer

_transfer_ids = itertools.count()


def _transfer_header(runner: ModelRunner, num_tokens: int, vocab_size: int) -> KvTransferHeader:
    kv = runner.kv
    layout = KvLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.block_size, DTYPE_NAMES[kv.dtype])
    return KvTransferHeader(
        request_id=f"profiler-kv-{num_tokens}-{next(_transfer_ids)}",
        prompt_token_ids=tuple(1 + i % (vocab_size - 1) for i in range(num_tokens)),
        output_token_ids=(1,),
        params=SamplingParams(max_tokens=2, seed=0, ignore_eos=True),  # one more token there, then done
        num_computed_tokens=num_tokens,
        layout=layout,
        total_bytes=2 * layout.num_layers * num_tokens * layout.bytes_per_token_per_layer,
        source_engine="profiler",
    )


async def _send_once(sender, runner: ModelRunner, num_tokens: int, vocab_size: int) -> float:
    header = _transfer_header(runner, num_tokens, vocab_size)
    outgoing = OutgoingKv(runner.kv, list(range(num_tokens)))  # as migrate_out hands it to a sender
    start = time.perf_counter()
    await sender(header, outgoing)
    return (time.perf_counter() - start) * 1e3


def kv_transfer(address: str, runner: ModelRunner, vocab_size: int, num_tokens: int, warmup: int,
                repeats: int, settle_s: float = 0.2, path: str = "tcp") -> Sample | None:
    """Time KV migrations of num_tokens tokens into the gpu_service at `address`, header to commit,
    over `path` ("tcp": the target's TCP data socket; "shm": straight into the target's blocks, which
    needs its pool in host memory on this host). None when the target declined that path (the
    transfer fails then). Each imported request decodes one token there and finishes; settle_s
    (untimed) lets it."""
    from dualpace.engine.transfer.kv_shm_send import MappedPools
    from dualpace.serve.kv_shm_transport import SameHostKvSender
    from dualpace.serve.kv_tcp_transport import TcpKvSender
    from dualpace.errors import Unavailable

    if num_tokens > runner.kv.num_blocks * runner.kv.block_size:
        raise ValueError(f"{num_tokens} tokens do not fit the bench's KV pool")
    if path not in ("shm", "tcp"):
        raise ValueError(f"unknown KV transfer path {path!r}")
    pools = MappedPools()
    senders = {"shm": lambda: SameHostKvSender(address, pools, {}), "tcp": lambda: TcpKvSender(address)}
    sender = senders[path]()

    async def run() -> list[float] | None:
        times = []
        try:
            for i in range(warmup + max(1, repeats)):
                try:
                    elapsed = await _send_once(sender, runner, num_tokens, vocab_size)
                except Unavailable:
                    return None  # the target declined the path (or its data socket could not be reached)
                if path == "shm" and not sender.used_shm:
                    return None  # shared memory declined, so it went over the data socket: not a shm figure
                await asyncio.sleep(settle_s)
                if i >= warmup:
                    times.append(elapsed)
        finally:
            pools.close()
        return times

    times = asyncio.run(run())
    return None if times is None else summarize(times)


def fit_transfer(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(bytes_per_s, fixed_ms) by least squares of ms = fixed + bytes / rate over (bytes, ms)."""
    n = len(points)
    xs = [float(b) for b, _ in points]
    ys = [ms for _, ms in points]
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x if var_x > 0 else 0.0
    if slope <= 0 or not math.isfinite(slope):  # too noisy to see a trend: the largest transfer's rate
        big = max(points)
        return 1000.0 * big[0] / max(big[1], 1e-6), max(0.0, min(ys))
    return 1000.0 / slope, max(0.0, mean_y - slope * mean_x)


def default_kv_transfer(fits: dict[str, KVTransfer], transfers: dict[str, list[tuple[int, float]]],
                        recompute: list[tuple[int, float]] | None) -> tuple[str, KVTransfer]:
    """(path, figures) of the profile's plain kv_transfer: the path the daemons take by default on this
    host, shm when measured, else tcp. `recompute` ((KV bytes, prefill ms) points, added to `transfers`):
    a model whose requests move without KV (EngineCore.moves_kv), where a move costs the target's prefill."""
    if recompute is not None:
        transfers["recompute"] = recompute
        return "recompute", KVTransfer(*(round(v, 4) for v in fit_transfer(recompute)))
    path = "shm" if "shm" in fits else "tcp"
    if path not in fits:
        raise RuntimeError("KV transfer: the profiler's gpu_service declined both shared memory and its data socket")
    return path, fits[path]


def kv_path_note(path: str) -> str:
    if path == "recompute":
        return ("kv_transfer is a recompute (gpu_prefill_ms): this model's sliding layers hold a KV pool of their "
                "own, so its requests move without KV")
    return f"kv_transfer over {path}"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
