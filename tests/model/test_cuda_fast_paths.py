"""What only CUDA can check: captured CUDA-graph decode steps equal the eager path token for token,
and the fused Triton kernels round bf16 exactly where torch does (the interpreter truncates, so the
CPU tests allow a rounding step). Skipped where CUDA is missing; run this file on its own (not after
the interpreter tests, which set TRITON_INTERPRET=1 for the whole process)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set in this process: run this file on its own", allow_module_level=True)

from dualpace.engine.core import EngineConfig  # noqa: E402
from dualpace.engine.runner import ModelRunner  # noqa: E402
from dualpace.engine.scheduler import SchedulerConfig  # noqa: E402
from dualpace.model import triton_fused  # noqa: E402
from dualpace.model.loader import load_model  # noqa: E402
from dualpace.model.rope import HalfAngles, apply_rotary  # noqa: E402
from dualpace.model.transformer import rms_norm  # noqa: E402
from dualpace.sampling import SamplingParams  # noqa: E402
from tests.model.test_decode_graphs import generate_through_engine  # noqa: E402


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_cuda_graph_decode_equals_eager_token_for_token(preset, synth_checkpoint):
    loaded = load_model(str(synth_checkpoint(preset)), dtype="fp32", device="cuda")
    config = EngineConfig(num_kv_blocks=128, block_size=16,
                          scheduler=SchedulerConfig(max_batch_tokens=256, max_running=12))
    prompts = [[5, 9, 2, 11, 40], [1] * 17, [300, 200, 100, 7, 7, 7, 3], list(range(10, 60)), [8]] * 2
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eager, _ = generate_through_engine(loaded, config, prompts, params, 0)
    replayed, runner = generate_through_engine(loaded, config, prompts, params, 12, capture=True)
    assert set(runner.decode_graphs.captured) == set(runner.decode_graphs.buckets)
    assert runner.decode_graphs.num_static_steps > 20
    assert replayed == eager


def test_fused_kernels_round_bf16_like_torch():
    torch.manual_seed(0)
    hidden, delta = torch.randn(5, 300, device="cuda").bfloat16(), torch.randn(5, 300, device="cuda").bfloat16()
    weight = torch.randn(300, device="cuda").bfloat16()
    summed, normed = triton_fused.add_rms_norm(hidden, delta, weight, 1e-5)
    assert torch.equal(summed, hidden + delta)
    assert (normed == rms_norm(summed, weight, 1e-5)).float().mean().item() > 0.99  # fp32 sums: order only
    gate_up = torch.randn(5, 2 * 700, device="cuda").bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert (triton_fused.silu_mul(gate_up) == torch.nn.functional.silu(gate) * up).float().mean().item() > 0.99
    head_dim, num_heads = 64, 6
    positions = torch.tensor([9, 0, 4000, 3, 3], device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = HalfAngles(freqs.cos(), freqs.sin())
    qkv = torch.randn(5, (num_heads + 2) * head_dim, device="cuda").bfloat16()
    cos, sin = angles.full(torch.bfloat16)
    expected = apply_rotary(qkv[:, : num_heads * head_dim].reshape(5, num_heads, head_dim), cos, sin)
    triton_fused.rotary_(qkv, num_heads, head_dim, angles.cos, angles.sin)
    assert torch.equal(qkv[:, : num_heads * head_dim].reshape(5, num_heads, head_dim), expected)


def test_kv_export_import_through_pinned_side_stream_copies(synth_checkpoint):
    from tests.engine.test_host_copies import kv_round_trip

    loaded = load_model(str(synth_checkpoint("tiny-llama")), dtype="bf16", device="cuda")
    runner = ModelRunner(loaded, num_blocks=8, block_size=8)
    assert runner.host_copies.staged
    kv_round_trip(runner)
    k, _ = runner.read_kv([1, 2, 3], 0)
    assert k.is_pinned()
