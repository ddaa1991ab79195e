"""Decode steps padded to batch-size buckets through static buffers (the inputs a CUDA graph replays):
the pure padding logic, and on CPU the padded static-buffer step run eagerly equals the unpadded
step, logits and KV, and whole generations through the engine are token-identical. The captured
CUDA graphs themselves are checked where CUDA exists (tests/model/test_cuda_fast_paths.py)."""

from __future__ import annotations

import pytest
import torch

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.engine.runner import ModelRunner
from dualpace.engine.scheduler import SchedulerConfig
from dualpace.kv.storage import KVStorage
from dualpace.model.decode_buckets import DecodeRow, bucket_for, decode_buckets, pad_decode, table_width_blocks
from dualpace.model.paged_forward import PagedForward, SequenceWork
from dualpace.model.static_decode import DecodeGraphs
from dualpace.sampling import SamplingParams
from tests.engine.test_engine_core import run_to_completion


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert decode_buckets(1) == [1]
    assert decode_buckets(10) == [1, 2, 4, 8, 10]
    buckets = decode_buckets(128)
    assert buckets[:5] == [1, 2, 4, 8, 16] and buckets[-1] == 128 and len(buckets) == 19
    assert all(bucket_for(n, buckets) - n < 8 for n in range(1, 129))
    assert bucket_for(3, buckets) == 4 and bucket_for(9, buckets) == 16 and bucket_for(129, buckets) is None
    with pytest.raises(ValueError):
        decode_buckets(0)
    assert table_width_blocks(100, 16, 1000) == 7 and table_width_blocks(100, 16, 3) == 3


def test_padding_rows_point_at_the_scratch_block():
    rows = [DecodeRow(7, 0, [4]), DecodeRow(9, 17, [2, 5, 8])]  # a table longer than its context needs
    padded = pad_decode(rows, bucket=4, table_width=3, block_size=16, scratch_block=30)
    assert padded.num_real == 2 and padded.bucket == 4
    assert padded.token_ids == [7, 9, 0, 0] and padded.positions == [0, 17, 0, 0]
    assert padded.slot_ids == [4 * 16, 5 * 16 + 1, 30 * 16, 30 * 16]
    assert padded.context_lens == [1, 18, 1, 1]
    assert padded.block_tables == [[4, 30], [2, 5], [30, 30], [30, 30]]  # the columns the contexts span
    assert padded.packed_rows() == [7, 9, 0, 0, 0, 17, 0, 0, 64, 81, 480, 480, 1, 18, 1, 1, 0, 17, 0, 0]
    assert pad_decode(rows, bucket=1, table_width=3, block_size=16, scratch_block=30) is None  # too many rows
    assert pad_decode(rows, bucket=4, table_width=1, block_size=16, scratch_block=30) is None  # table too wide
    assert pad_decode([DecodeRow(1, 16, [3])], 1, 4, 16, 30) is None  # the table misses the new token's block


def _random_kv(cfg, num_blocks: int, block_size: int) -> KVStorage:
    torch.manual_seed(1)
    kv = KVStorage(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv.k.copy_(torch.randn_like(kv.k))
    kv.v.copy_(torch.randn_like(kv.v))
    return kv


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_padded_static_step_equals_the_unpadded_step(preset, synth_checkpoint):
    from dualpace.model.loader import load_model

    loaded = load_model(str(synth_checkpoint(preset)), dtype="fp32")
    num_blocks, block_size = 24, 4
    work = [SequenceWork([7], 4, [23, 22]), SequenceWork([11], 18, [0, 4, 8, 12, 16]),
            SequenceWork([3], 9, [1, 5, 9, 13])]  # scattered, out-of-order tables of different lengths
    eager_kv = _random_kv(loaded.config, num_blocks + 1, block_size)  # block 24: the scratch block
    static_kv = _random_kv(loaded.config, num_blocks + 1, block_size)
    expected = PagedForward(loaded.model, eager_kv).forward(work)
    graphs = DecodeGraphs(PagedForward(loaded.model, static_kv), max_batch=8, table_width=6, scratch_block=24)
    logits = graphs.run(work)  # bucket 4: one padding row
    assert graphs.num_static_steps == 1 and logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    # the same KV everywhere but the scratch block, where only padding rows wrote
    assert torch.equal(static_kv.k[:, :num_blocks], eager_kv.k[:, :num_blocks])
    assert torch.equal(static_kv.v[:, :num_blocks], eager_kv.v[:, :num_blocks])
    prefill = [SequenceWork([1, 2, 3], 0, [2])]
    assert graphs.run(prefill) is None and graphs.num_eager_steps == 1  # prefill runs eagerly
    assert graphs.run([SequenceWork([1], 40, list(range(11)))]) is None  # wider than the static tables


def generate_through_engine(loaded, config: EngineConfig, prompts: list[list[int]], params: SamplingParams,
                            decode_graph_batch: int, capture: bool = False) -> tuple[dict, ModelRunner]:
    """Every prompt's tokens from one EngineCore whose runner has static decode buffers (when
    decode_graph_batch > 0; captured as CUDA graphs when `capture`), and the runner."""
    runner = ModelRunner(loaded, config.num_kv_blocks, config.block_size, decode_graph_batch=decode_graph_batch)
    if capture:
        runner.capture_decode_graphs()
    core = EngineCore(loaded, config, runner)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    return run_to_completion(core), runner


def test_generation_through_static_buffers_is_token_identical(tiny):
    config = EngineConfig(num_kv_blocks=64, block_size=8, scheduler=SchedulerConfig(max_batch_tokens=64, max_running=6))
    prompts = [[5, 9, 2, 11, 40], [1] * 17, [300, 200, 100, 7, 7, 7, 3], list(range(10, 40)), [8], [9, 9]]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    eager, _ = generate_through_engine(tiny, config, prompts, params, 0)
    static, runner = generate_through_engine(tiny, config, prompts, params, 6)
    assert runner.decode_graphs.num_static_steps > 5  # most decode steps ran through the buffers
    assert runner.kv.num_blocks == config.num_kv_blocks + 1
    assert static == eager
