"""The fused RMSNorm (+ residual add) and RoPE Triton kernels, run by Triton's interpreter on CPU
tensors, against the torch ops of dualpace.model.transformer they replace on CUDA: odd hidden
sizes, head_dim variants, positions out of order, and whole-model steps and greedy generation on
the tiny models token-identical to the torch path. On CUDA the same kernels are compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model.triton_interpreter import use_kernels  # sets TRITON_INTERPRET=1 before triton loads

from dualpace.generation import OfflineGenerator  # noqa: E402
from dualpace.kv.storage import KVStorage  # noqa: E402
from dualpace.model import cpu_kernels, triton_fused  # noqa: E402
from dualpace.model.attention_backend import KernelChoices, uses_fused_triton, uses_triton  # noqa: E402
from dualpace.model.loader import load_model  # noqa: E402
from dualpace.model.paged_forward import PagedForward, SequenceWork  # noqa: E402
from dualpace.model.rope import HalfAngles, apply_rotary  # noqa: E402
from dualpace.model.transformer import rms_norm  # noqa: E402
from dualpace.sampling import SamplingParams  # noqa: E402


@pytest.mark.parametrize("hidden_size", [1, 7, 33, 100, 576])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_rms_norm_equals_torch_fp32(hidden_size, num_tokens):
    torch.manual_seed(hidden_size)
    x = torch.randn(num_tokens, hidden_size) * 3
    weight = torch.randn(hidden_size)
    out = triton_fused.rms_norm(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert (out - rms_norm(x, weight, 1e-5)).abs().max().item() < 1e-5


@pytest.mark.parametrize("hidden_size", [9, 64, 257])
def test_add_rms_norm_equals_residual_add_then_norm(hidden_size):
    torch.manual_seed(0)
    hidden, delta, weight = torch.randn(4, hidden_size), torch.randn(4, hidden_size), torch.randn(hidden_size)
    summed, normed = triton_fused.add_rms_norm(hidden, delta, weight, 1e-6)
    assert torch.equal(summed, hidden + delta)
    assert (normed - rms_norm(hidden + delta, weight, 1e-6)).abs().max().item() < 1e-5


def _within_bf16_steps(out: torch.Tensor, reference: torch.Tensor, num_roundings: int = 1,
                       magnitude: torch.Tensor | None = None) -> bool:
    """The interpreter (triton 3.9) truncates fp32 -> bf16 where CUDA rounds to nearest, so under it
    a bf16 result may sit a bf16 step from torch's per rounding (exactness is checked on CUDA:
    tests/model/test_cuda_fast_paths.py)."""
    magnitude = reference.float().abs() if magnitude is None else magnitude
    tolerance = magnitude * num_roundings * 2**-7 + 1e-6
    return bool(((out.float() - reference.float()).abs() <= tolerance).all())


def test_bf16_norms_are_within_a_rounding_step_of_torch():
    torch.manual_seed(3)
    hidden, delta = torch.randn(3, 96).bfloat16(), torch.randn(3, 96).bfloat16()
    weight = torch.randn(96).bfloat16()
    summed, normed = triton_fused.add_rms_norm(hidden, delta, weight, 1e-5)
    assert summed.dtype == normed.dtype == torch.bfloat16
    assert _within_bf16_steps(summed, hidden + delta)
    assert _within_bf16_steps(normed, rms_norm(summed, weight, 1e-5), num_roundings=2)


@pytest.mark.parametrize("width", [1, 37, 1500])  # 1500: two programs per token
def test_silu_mul_equals_torch(width):
    torch.manual_seed(width)
    gate_up = torch.randn(3, 2 * width) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    out = triton_fused.silu_mul(gate_up)
    assert out.shape == (3, width)
    assert (out - F.silu(gate) * up).abs().max().item() < 1e-5
    bf16 = gate_up.bfloat16()
    gate, up = bf16.chunk(2, dim=-1)
    assert _within_bf16_steps(triton_fused.silu_mul(bf16), F.silu(gate) * up, num_roundings=2)


def _rope_inputs(num_heads, num_kv_heads, head_dim, dtype):
    torch.manual_seed(head_dim)
    positions = torch.tensor([7, 0, 33, 2, 2, 100, 4095])  # out of order, repeated, large
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = HalfAngles(freqs.cos(), freqs.sin())
    qkv = torch.randn(len(positions), (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    return qkv, angles


def _torch_rope(qkv, num_heads, num_kv_heads, head_dim, angles, dtype):
    cos, sin = angles.full(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    num_tokens = qkv.shape[0]
    return (apply_rotary(q.reshape(num_tokens, num_heads, head_dim), cos, sin).reshape(num_tokens, -1),
            apply_rotary(k.reshape(num_tokens, num_kv_heads, head_dim), cos, sin).reshape(num_tokens, -1), v)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [
    (4, 2, 16), (3, 1, 8), (6, 2, 24), (2, 2, 64), (5, 5, 6),  # head_dim/2 of 3, 12: not powers of two
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_q_and_k_in_one_launch_like_torch(num_heads, num_kv_heads, head_dim, dtype):
    qkv, angles = _rope_inputs(num_heads, num_kv_heads, head_dim, dtype)
    magnitude = qkv.float().abs().max()  # of the products whose rounding the outputs carry
    q_ref, k_ref, v_ref = _torch_rope(qkv.clone(), num_heads, num_kv_heads, head_dim, angles, dtype)
    triton_fused.rotary_(qkv, num_heads + num_kv_heads, head_dim, angles.cos, angles.sin)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    assert torch.equal(v, v_ref)  # v is not rotated
    if dtype == torch.float32:
        assert (q - q_ref).abs().max().item() < 1e-5 and (k - k_ref).abs().max().item() < 1e-5
    else:  # each product rounded to bf16 where torch rounds it (to nearest on CUDA; truncated here)
        assert _within_bf16_steps(q, q_ref, 4, magnitude) and _within_bf16_steps(k, k_ref, 4, magnitude)


def test_rotary_refuses_angles_of_the_wrong_shape():
    qkv, angles = _rope_inputs(2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        triton_fused.rotary_(qkv, 3, 16, angles.cos[:, :4], angles.sin[:, :4])
    with pytest.raises(ValueError, match="unit stride"):
        triton_fused.rotary_(qkv.t(), 3, 16, angles.cos, angles.sin)


def _logits_and_greedy(folder: str, fused: str, monkeypatch):
    use_kernels(monkeypatch, fused_kernels=fused)
    loaded = load_model(folder, dtype="fp32")
    assert loaded.model._fused_triton == (fused == "triton")
    cfg = loaded.config
    prompts = [[5, 9, 2, 11, 40, 3, 3, 8, 1, 17, 19, 21, 22, 23, 24, 25, 26, 2], [7, 7, 1], [30] * 5]
    kv = KVStorage(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, loaded.model.device)
    logits = PagedForward(loaded.model, kv).forward([
        SequenceWork(prompts[0], 0, [5, 2], all_logits=True), SequenceWork(prompts[1], 0, [0])])
    params = [SamplingParams(max_tokens=10, ignore_eos=True)] * len(prompts)
    return logits, [r.output_token_ids for r in OfflineGenerator(loaded).generate(prompts, params)]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-qwen3", "tiny-phi3", "tiny-gemma3",
                                    "tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"])
def test_whole_model_with_fused_kernels_is_token_identical_to_torch(preset, synth_checkpoint, monkeypatch):
    use_kernels(monkeypatch, attention_backend="gather")
    enabled = cpu_kernels._state.get("enabled", True)
    cpu_kernels.set_enabled(False)  # the reference: plain torch ops
    try:
        folder = str(synth_checkpoint(preset))
        fused_logits, fused_tokens = _logits_and_greedy(folder, "triton", monkeypatch)
        torch_logits, torch_tokens = _logits_and_greedy(folder, "torch", monkeypatch)
    finally:
        cpu_kernels.set_enabled(enabled)
    assert (fused_logits - torch_logits).abs().max().item() < 1e-5 * torch_logits.abs().max().item()
    assert fused_tokens == torch_tokens


def test_fused_kernels_auto_and_torch_mean_torch_ops_on_cpu(monkeypatch):
    for value in ("auto", "torch"):  # auto: Triton on CUDA only
        use_kernels(monkeypatch, fused_kernels=value)
        assert not uses_fused_triton(torch.device("cpu"))


@pytest.mark.parametrize("name, uses", [("attention_backend", uses_triton), ("fused_kernels", uses_fused_triton)])
def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error(name, uses, monkeypatch):
    use_kernels(monkeypatch, **{name: "triton"})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        uses(torch.device("cpu"))
    with pytest.raises(ValueError, match=name):
        KernelChoices(**{name: "fastest"})


def test_static_decode_buffers_through_the_triton_kernels_equal_the_torch_path(synth_checkpoint, monkeypatch):
    """What a CUDA graph replays (padded static buffers: start positions, stale table columns), run
    eagerly through the paged and fused Triton kernels, against the torch path without buffers."""
    from dualpace.engine.core import EngineConfig
    from dualpace.engine.scheduler import SchedulerConfig
    from tests.model.test_decode_graphs import generate_through_engine

    folder = str(synth_checkpoint("tiny-llama"))
    config = EngineConfig(num_kv_blocks=32, block_size=16,
                          scheduler=SchedulerConfig(max_batch_tokens=64, max_running=4))
    prompts = [[5, 9, 2, 11, 40], [1] * 17, list(range(10, 40)), [8]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    enabled = cpu_kernels._state.get("enabled", True)
    cpu_kernels.set_enabled(False)
    try:
        for kernels, graph_batch in (("triton", 4), ("torch", 0)):
            use_kernels(monkeypatch, fused_kernels=kernels)
            use_kernels(monkeypatch, attention_backend="triton" if kernels == "triton" else "gather")
            outputs[kernels], runner = generate_through_engine(load_model(folder, dtype="fp32"), config, prompts,
                                                               params, graph_batch)
            if graph_batch:
                assert runner.decode_graphs.steps[4].step.varlen is not None  # the paged kernel's inputs
                assert runner.decode_graphs.num_static_steps > 5
    finally:
        cpu_kernels.set_enabled(enabled)
    assert outputs["triton"] == outputs["torch"]
