"""SplitForward: a GPU step with remote rows, JOINED and SPLIT.

The remote rows' K/V and attention live on a fake CPU side: its own KVStorage, attended as
AssistedForward does. Greedy tokens must equal Hugging Face's in fp32, logits a plain
PagedForward's to 1e-4, for JOINED (no S0) and SPLIT (S0 carries a prefill and decodes)."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.errors import Overloaded
from dualpace.kv.storage import KVStorage
from dualpace.model import split_forward as split_module
from dualpace.model.loader import load_model
from dualpace.model.paged_forward import PagedForward, SequenceWork, attend, build_step_tensors
from dualpace.model.split_forward import RemoteBatch, RemoteRows, SplitForward
from tests.model.hf_reference import hf_greedy

BLOCK_SIZE = 4
NUM_STEPS = 33  # after the prefills: at least 32 greedy tokens per sequence
LOGIT_TOLERANCE = 1e-4


class AttendingChannel:
    """The CPU side of one join: writes the rows' K/V into its own storage and attends there."""

    def __init__(self, kv: KVStorage, scale: float, stall_at_layer: int | None = None, layer_window=None):
        self.kv, self.scale, self.stall_at_layer = kv, scale, stall_at_layer
        self.layer_window = layer_window or (lambda layer: None)  # ModelConfig.layer_window
        self.step = None  # the rows' StepTensors on the CPU side, set per step
        self.outputs: dict[int, torch.Tensor] = {}
        self.errors: list[BaseException] = []
        self.finished = None

    def send_qkv(self, layer, q, k, v):
        window = self.layer_window(layer)
        step = self.step.for_layer(window)
        self.kv.write(layer, step.slot_ids, k, v)
        self.outputs[layer] = attend(q.clone(), layer, step, self.kv, self.scale, window=window)

    def receive_attention(self, layer, deadline_s):
        if layer == self.stall_at_layer:
            return None
        return self.outputs.pop(layer)

    def finish(self, logits_rows, info):
        self.finished = (logits_rows, info)

    def fail(self, error):
        self.errors.append(error)


@dataclass
class Seq:
    name: str
    prompt: list[int]
    block_ids: list[int]
    remote: bool = False
    in_s1: bool = False  # own decodes moved into S1 (D1)
    prefill_in_step: bool = False  # its prompt runs in the first split step (S0), not before
    tokens: list[int] = field(default_factory=list)
    window_block_ids: list[int] | None = None  # the sliding layers' table, where they have a pool of their own

    def work(self) -> SequenceWork:
        if not self.tokens:
            return SequenceWork(self.prompt, 0, self.block_ids, window_block_ids=self.window_block_ids)
        return SequenceWork([self.tokens[-1]], len(self.prompt) + len(self.tokens) - 1, self.block_ids,
                            window_block_ids=self.window_block_ids)


def make_seqs(vocab_size: int, layout: str) -> list[Seq]:
    rng = random.Random(layout)
    specs = [("own_a", False, False, False), ("own_b", False, True, False), ("remote_c", True, False, False),
             ("remote_d", True, False, False), ("own_e", False, layout == "joined", layout == "split")]
    seqs, next_block = [], 1
    for name, remote, in_s1, prefill_in_step in specs:
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(5, 12))]
        num_blocks = -(-(len(prompt) + NUM_STEPS + 1) // BLOCK_SIZE)
        seqs.append(Seq(name, prompt, list(range(next_block + num_blocks - 1, next_block - 1, -1)), remote,
                        in_s1 or (layout == "joined" and not remote), prefill_in_step))
        next_block += num_blocks
    return seqs


def new_kv(loaded, num_blocks: int = 128) -> KVStorage:
    """A model mixing sliding and global layers (Gemma 3) gets a pool of its sliding layers' own, as
    its engines do (dualpace.engine.core.kv_pool_sizes)."""
    cfg = loaded.config
    num_window_blocks = num_blocks if cfg.window_layers is not None and cfg.sliding_window is not None else 0
    return KVStorage(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, loaded.model.dtype,
                     window_layers=cfg.window_layers, num_window_blocks=num_window_blocks)


def give_window_tables(kv: KVStorage, seqs: list[Seq]) -> None:
    """With a sliding pool: tables there that differ from the global ones (the ids mirrored), so a
    layer that wrote through one pool's slots and read through the other's would read wrong KV."""
    if kv.has_window_pool:
        for s in seqs:
            s.window_block_ids = [kv.num_window_blocks - 1 - b for b in s.block_ids]


def greedy(logits: torch.Tensor) -> int:
    return int(logits.argmax())


def run_plain(loaded, seqs: list[Seq]) -> list[dict[str, torch.Tensor]]:
    """Every sequence through one plain PagedForward per step; the logits of each step by name."""
    kv = new_kv(loaded)
    give_window_tables(kv, seqs)
    forward = PagedForward(loaded.model, kv)
    first = [s for s in seqs if not s.prefill_in_step]
    per_step = [dict(zip([s.name for s in first], forward.forward([s.work() for s in first])))]
    for s in first:
        s.tokens.append(greedy(per_step[0][s.name]))
    for _ in range(NUM_STEPS):
        logits = dict(zip([s.name for s in seqs], forward.forward([s.work() for s in seqs])))
        for s in seqs:
            s.tokens.append(greedy(logits[s.name]))
        per_step.append(logits)
    return per_step


def split_step(split: SplitForward, gpu_kv: KVStorage, seqs: list[Seq], channels: dict[str, AttendingChannel]):
    """One SplitForward step over `seqs`; the logits by name (dropped joins absent) and the output."""
    s0_seqs = [s for s in seqs if not s.remote and not s.in_s1]
    d1_seqs = [s for s in seqs if s.in_s1]
    remote_seqs = [s for s in seqs if s.remote]
    joins = []
    for s in remote_seqs:
        work = s.work()
        channel = channels[s.name]
        channel.step = build_step_tensors([work], BLOCK_SIZE, torch.device("cpu"))
        joins.append(RemoteRows(channel, work.token_ids, [work.start_pos], wait_bound_s=10.0))
    s0 = build_step_tensors([s.work() for s in s0_seqs], BLOCK_SIZE, gpu_kv.device) if s0_seqs else None
    s1 = build_step_tensors([s.work() for s in d1_seqs], BLOCK_SIZE, gpu_kv.device) if d1_seqs else None
    out = split.run(s0, s1, RemoteBatch(joins), gpu_kv)
    logits = dict(zip([s.name for s in s0_seqs + d1_seqs], out.own_logits))
    for s, join in zip(remote_seqs, joins):
        for finished, rows in out.finished:
            if finished is join:
                logits[s.name] = rows[0]
    return logits, out


def run_split(loaded, seqs: list[Seq], stall: dict[str, int] | None = None):
    gpu_kv, cpu_kv = new_kv(loaded), new_kv(loaded)
    give_window_tables(gpu_kv, seqs)
    plain_gpu, plain_cpu = PagedForward(loaded.model, gpu_kv), PagedForward(loaded.model, cpu_kv)
    split = SplitForward(loaded.model)
    channels = {s.name: AttendingChannel(cpu_kv, split.scale, (stall or {}).get(s.name), loaded.config.layer_window)
                for s in seqs if s.remote}
    first: dict[str, torch.Tensor] = {}
    for forward, group in ((plain_gpu, [s for s in seqs if not s.remote and not s.prefill_in_step]),
                           (plain_cpu, [s for s in seqs if s.remote])):  # the CPU engine prefills locally
        first.update(zip([s.name for s in group], forward.forward([s.work() for s in group])))
    for s in seqs:
        if s.name in first:
            s.tokens.append(greedy(first[s.name]))
    per_step, outputs = [first], []
    for _ in range(NUM_STEPS):
        logits, out = split_step(split, gpu_kv, seqs, channels)
        for s in seqs:
            s.tokens.append(greedy(logits[s.name]) if s.name in logits else -1)
        per_step.append(logits)
        outputs.append(out)
        for s in seqs:
            if s.remote and any(j.channel is channels[s.name] for j in out.dropped):
                seqs = [x for x in seqs if x is not s]
    return per_step, outputs, channels


@pytest.fixture(scope="module")
def tiny(synth_checkpoint):
    folder = synth_checkpoint("tiny-llama")
    return load_model(str(folder), dtype="fp32"), AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])  # gemma3: its sliding layers' own pool
@pytest.mark.parametrize("layout", ["joined", "split"])
def test_remote_rows_match_transformers_and_a_plain_step(synth_checkpoint, preset, layout):
    folder = synth_checkpoint(preset)
    loaded = load_model(str(folder), dtype="fp32")
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plain_seqs, seqs = make_seqs(loaded.config.vocab_size, layout), make_seqs(loaded.config.vocab_size, layout)
    plain = run_plain(loaded, plain_seqs)
    split, outputs, channels = run_split(loaded, seqs)
    if layout == "joined":
        assert all(s.in_s1 or s.remote for s in seqs)
    assert all(not out.dropped for out in outputs) and all(not c.errors for c in channels.values())
    for step, (want, got) in enumerate(zip(plain, split)):
        assert set(want) == set(got), step
        for name in want:
            diff = (want[name] - got[name]).abs().max().item()
            assert diff < LOGIT_TOLERANCE, f"step {step} {name}: max |logit diff| {diff}"
    for s in seqs:
        assert len(s.tokens) >= 32
        assert s.tokens == hf_greedy(hf_model, s.prompt, len(s.tokens)), s.name


def test_a_stalled_join_is_dropped_and_nothing_else_changes(tiny):
    loaded, _ = tiny
    plain = run_plain(loaded, make_seqs(loaded.config.vocab_size, "split"))
    seqs = make_seqs(loaded.config.vocab_size, "split")
    split, outputs, channels = run_split(loaded, seqs, stall={"remote_c": 1})
    assert [j.channel for j in outputs[0].dropped] == [channels["remote_c"]]
    assert outputs[0].dropped[0].dropped_at_layer == 1
    assert len(channels["remote_c"].errors) == 1 and isinstance(channels["remote_c"].errors[0], Overloaded)
    assert channels["remote_c"].finished is None
    assert all(not out.dropped for out in outputs[1:])
    for step, (want, got) in enumerate(zip(plain, split)):
        for name in got:  # every other row, own and remote, as without the stall
            diff = (want[name] - got[name]).abs().max().item()
            assert diff < LOGIT_TOLERANCE, f"step {step} {name}: max |logit diff| {diff}"
    assert "remote_c" not in split[1] and "remote_d" in split[1]


class ReleasedChannel(AttendingChannel):
    """Answers a layer's attention only when the test releases it; records when it was asked."""

    def __init__(self, kv, scale, events):
        super().__init__(kv, scale)
        self.events = events
        self.asked = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def send_qkv(self, layer, q, k, v):
        self.events.append(("send", q.shape[0]))
        super().send_qkv(layer, q, k, v)

    def receive_attention(self, layer, deadline_s):
        self.events.append(("wait", layer))
        self.asked.release()
        assert self.release.acquire(timeout=30)
        return super().receive_attention(layer, deadline_s)


def test_order_in_each_layer_lets_the_cpu_attend_while_the_gpu_works(tiny, monkeypatch):
    """pre(S1), the qkv sent, S0's whole layer, attend(D1), then the wait, then post(S1): the GPU
    has S0's layer and D1's attention to do while the CPU attends (structural, no timing)."""
    loaded, _ = tiny
    model = loaded.model
    events: list[tuple] = []
    for stage in ("pre_attention", "post_attention"):
        original = getattr(model, stage)
        monkeypatch.setattr(model, stage, lambda layer, hidden, *rest, _o=original, _s=stage:
                            (events.append((_s, hidden.shape[0])), _o(layer, hidden, *rest))[1])
    monkeypatch.setattr(split_module, "attend",
                        lambda q, *rest: (events.append(("attend", q.shape[0])), attend(q, *rest))[1])
    gpu_kv, cpu_kv = new_kv(loaded), new_kv(loaded)
    split = SplitForward(model)
    channel = ReleasedChannel(cpu_kv, split.scale, events)
    channel.step = build_step_tensors([SequenceWork([5], 0, [3])], BLOCK_SIZE, torch.device("cpu"))
    s0 = build_step_tensors([SequenceWork([1, 2, 3], 0, [1])], BLOCK_SIZE, gpu_kv.device)  # a 3-token prefill
    s1 = build_step_tensors([SequenceWork([4], 0, [2])], BLOCK_SIZE, gpu_kv.device)  # one own decode
    thread = threading.Thread(target=split.run, args=(s0, s1, RemoteBatch([RemoteRows(channel, [5], [0], 30.0)]),
                                                      gpu_kv))
    thread.start()
    for layer in range(model.config.num_layers):
        assert channel.asked.acquire(timeout=30)
        layer_events = events[[i for i, e in enumerate(events) if e == ("pre_attention", 2)][layer]:]
        assert layer_events == [("pre_attention", 2), ("send", 1), ("pre_attention", 3), ("attend", 3),
                                ("post_attention", 3), ("attend", 1), ("wait", layer)], layer
        channel.release.release()
    thread.join(30)
    assert events[-1] == ("post_attention", 2)
