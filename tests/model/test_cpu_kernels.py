"""The CPU kernels (dualpace.model.cpu_kernels) against plain torch on the same inputs, for every
instruction-set variant this CPU runs (the others are skipped by name)."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
import torch.nn.functional as F

from dualpace.model import cpu_kernels
from dualpace.model import cpu_kernels_build as kbuild
from dualpace.model.attention import decode_attention
from dualpace.model.cpu_fused_decode import FusedDecode
from dualpace.model.rope import apply_rotary
from dualpace.model.transformer import rms_norm

_SUPPORTED = kbuild.supported_variants()
VARIANTS = [pytest.param(name, id=name, marks=pytest.mark.skipif(name not in _SUPPORTED,
                                                                 reason=f"this CPU lacks the features of {name}"))
            for name in kbuild.VARIANTS]


@contextlib.contextmanager
def one_region(kernels, enabled: bool):
    """Decode steps of `kernels` as one parallel region where it applies (True, the default) or as
    one region per operation (False) inside the block."""
    before = kernels.set_one_region(enabled)
    try:
        yield
    finally:
        kernels.set_one_region(before)


@pytest.fixture(params=VARIANTS)
def kernels(request):
    """One variant's kernels, also what cpu_kernels.get() returns while the test runs."""
    previous = cpu_kernels._state.copy()
    loaded = cpu_kernels.select_variant(request.param)
    if loaded is None:
        if shutil.which("g++") is None:
            pytest.skip("no g++ here: the CPU kernels cannot be built")
        pytest.fail(f"variant {request.param} did not build or load (see the log)")
    yield loaded
    cpu_kernels._state.clear()
    cpu_kernels._state.update(previous)


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= rel * scale, f"max error {err} vs scale {scale}"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 32])  # every tile shape (rows_bf16dot)
# 80, 17: the lone-row AVX2 path's half block and tail; 1600 and 4100: up to 8 rows of x against tiles of
# several W rows (bf16_one_w_row_max_k)
@pytest.mark.parametrize("k", [64, 576, 100, 80, 17, 1600, 4100])
def test_linear_bf16_matches_fp32_math(kernels, rows, k):
    torch.manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k).bfloat16()
    w = torch.randn(37, k).bfloat16()
    bias = torch.randn(37).bfloat16()
    residual = torch.randn(rows, 37).bfloat16()
    expected = x.float() @ w.float().t() + bias.float() + residual.float()
    # rows above dense_max_rows go to oneDNN, whose output is bf16
    fp32_rel = 1e-5 if rows <= kernels.dense_max_rows(torch.bfloat16) else 1e-2
    _close(kernels.linear(x, w, bias, residual, out_dtype=torch.float32), expected, fp32_rel)
    _close(kernels.linear(x, w, bias, residual), expected, 1e-2)
    _close(kernels.linear(x, w), x.float() @ w.float().t(), 1e-2)


@pytest.mark.parametrize("rows", [1, 3, 8, 12])
@pytest.mark.parametrize("k", [100, 576, 2100])  # 2100: one row of x against two W rows per tile
def test_linear_fp32(kernels, rows, k):
    torch.manual_seed(rows + k)
    x, w, bias = torch.randn(rows, k), torch.randn(29, k), torch.randn(29)
    expected = x.double() @ w.double().t() + bias.double()
    _close(kernels.linear(x, w, bias), expected, 1e-5)


@pytest.mark.parametrize("rows", [1, 2, 7, 12, 32, 33, 100])
@pytest.mark.parametrize("k", [200, 4100])  # 4100: one row of x against two W rows per tile
def test_linear_fp32_activations_bf16_weights(kernels, rows, k):
    """bf16 matrices with fp32 compute: the kernel widens the weights (up to MIXED_MAX_ROWS rows),
    more rows widen the matrix once for oneDNN; both are fp32 math on the bf16 values."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, k), torch.randn(45, k).bfloat16()
    residual = torch.randn(rows, 45)
    expected = x.double() @ w.double().t() + residual.double()
    out = kernels.linear(x, w, residual=residual)
    assert out.dtype == torch.float32
    _close(out, expected, 1e-5)


def test_linear_weight_rows_with_padding(kernels):
    """A weight whose rows are further apart than K elements (row_bytes > K * element size)."""
    for dtype in (torch.bfloat16, torch.float32):
        wide = torch.randn(19, 160).to(dtype)
        w = wide[:, :130]
        x = torch.randn(3, 130).to(dtype)
        _close(kernels.linear(x, w, out_dtype=torch.float32), x.double() @ w.double().t(), 1e-5)
        _close(kernels.linear(x[:1], w, out_dtype=torch.float32), x[:1].double() @ w.double().t(), 1e-5)


def test_widen_bf16(kernels):
    t = torch.randn(3, 70001).bfloat16()
    assert torch.equal(kernels.widen(t), t.float())


def test_linear_strided_input(kernels):
    x = torch.randn(4, 96).bfloat16()[:, :64]
    w = torch.randn(8, 64).bfloat16()
    _close(kernels.linear(x, w, out_dtype=torch.float32), x.float() @ w.float().t(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rotary_silu(kernels, dtype):
    torch.manual_seed(0)
    rel = 1e-6 if dtype == torch.float32 else 1e-2
    x = torch.randn(5, 72, dtype=dtype)
    w = torch.randn(72, dtype=dtype)
    _close(kernels.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), rel)

    num_heads, head_dim = 5, 24
    qkv = torch.randn(3, (num_heads + 2) * head_dim, dtype=dtype)
    angles = torch.rand(3, head_dim // 2) * 6
    full = torch.cat((angles, angles), dim=-1)[:, None, :]
    expected = apply_rotary(qkv[:, : 4 * head_dim].float().view(3, 4, head_dim), full.cos(), full.sin())
    rotated = qkv.clone()
    kernels.rotary_(rotated, 4, head_dim, angles.cos().contiguous(), angles.sin().contiguous())
    _close(rotated[:, : 4 * head_dim].view(3, 4, head_dim), expected, rel)
    assert torch.equal(rotated[:, 4 * head_dim:], qkv[:, 4 * head_dim:])

    gate_up = torch.randn(3, 2 * 40, dtype=dtype) * 4
    gate, up = gate_up.float().chunk(2, dim=-1)
    _close(kernels.silu_mul(gate_up), F.silu(gate) * up, rel)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 16), (torch.float32, 64), (torch.bfloat16, 64),
                                            (torch.bfloat16, 128), (torch.float32, 128), (torch.bfloat16, 32)])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("num_kv_heads", [1, 2])  # 1: MQA
def test_decode_attention_matches_torch(kernels, dtype, head_dim, group, num_kv_heads):
    torch.manual_seed(head_dim + group)
    block_size, num_blocks = 16, 80
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    lens = torch.tensor([1, 17, 300, 1000, 33])  # a single sequence below exercises context splits
    tables = torch.stack([torch.randperm(num_blocks)[:64] for _ in lens])
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    reference = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    _close(ours, reference, rel)
    solo = kernels.decode_attention(q[3:4], k_cache, v_cache, tables[3:4], lens[3:4], scale)
    _close(solo, reference[3:4], rel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [4, 8, 32])
def test_decode_attention_block_sizes_ignore_unused_slots(kernels, dtype, block_size):
    """Blocks smaller and larger than the kernel's 16-token chunks; slots past each context hold
    NaN and must not leak into the output."""
    torch.manual_seed(block_size)
    num_kv_heads, group, head_dim, num_blocks = 3, 3, 64, 200
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    lens = torch.tensor([1, 5, 31, 47, 250, 600])
    max_blocks = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, dtype=dtype)
    scale = head_dim ** -0.5
    reference = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for row, n in zip(tables, lens.tolist()):
        slots = row[:, None] * block_size + torch.arange(block_size)
        used[slots.flatten()[:n]] = True
    k_cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
    v_cache.view(-1, num_kv_heads, head_dim)[~used] = float("nan")
    ours = kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert not ours.isnan().any()
    _close(ours, reference, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype,num_kv_heads,group,head_dim", [(torch.bfloat16, 16, 5, 64),
                                                               (torch.bfloat16, 8, 7, 128),
                                                               (torch.float32, 16, 5, 64)])
def test_decode_attention_many_heads_and_splits(kernels, dtype, num_kv_heads, group, head_dim):
    """More query heads than the kernel's stack buffers hold, and one long context split many ways."""
    torch.manual_seed(num_kv_heads * group)
    block_size, num_blocks = 16, 300
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    lens = torch.tensor([4000, 3])
    tables = torch.stack([torch.randperm(num_blocks)[:250] for _ in lens])
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, dtype=dtype) * 2
    scale = head_dim ** -0.5
    reference = decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    _close(kernels.decode_attention(q, k_cache, v_cache, tables, lens, scale), reference,
           1e-5 if dtype == torch.float32 else 2e-2)
    solo = kernels.decode_attention(q[:1], k_cache, v_cache, tables[:1], lens[:1], scale)
    _close(solo, reference[:1], 1e-5 if dtype == torch.float32 else 2e-2)


def decode_attention_reference(q, k_cache, v_cache, tables, lens, scale):
    with torch.no_grad():
        cpu_kernels.set_enabled(False)
        try:
            return decode_attention(q, k_cache, v_cache, tables, lens, scale)
        finally:
            cpu_kernels.set_enabled(True)


def test_kv_write_scatters_rows(kernels):
    k_cache = torch.zeros(4, 2, 3, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(2, 9 * 8).bfloat16()
    k = qkv[:, 24:48].view(2, 3, 8)
    v = qkv[:, 48:].view(2, 3, 8)
    assert kernels.kv_write(k_cache, v_cache, torch.tensor([5, 2]), k, v)
    assert torch.equal(k_cache.view(8, 3, 8)[5], k[0]) and torch.equal(v_cache.view(8, 3, 8)[2], v[1])


def _decode_logits(loaded, fused: bool, kernels_on: bool) -> torch.Tensor:
    """Logits of one decode step of 3 sequences (contexts 5, 19, 40) over scattered blocks."""
    from dualpace.kv.storage import KVStorage
    from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors

    cfg = loaded.config
    torch.manual_seed(1)
    kv = KVStorage(cfg.num_layers, 40, 4, cfg.num_kv_heads, cfg.head_dim, loaded.model.dtype)
    kv.k.copy_(torch.randn_like(kv.k, dtype=torch.float32))
    kv.v.copy_(torch.randn_like(kv.v, dtype=torch.float32))
    tables = [list(range(39, 37, -1)), list(range(0, 20, 4)), list(range(1, 40, 4))]
    work = [SequenceWork([7], 4, tables[0]), SequenceWork([11], 18, tables[1]), SequenceWork([3], 39, tables[2])]
    enabled = cpu_kernels._state.get("enabled", True)
    cpu_kernels.set_enabled(kernels_on)
    try:
        forward = PagedForward(loaded.model, kv)
        if fused:
            assert forward._fused_decode(build_step_tensors(work, kv.block_size, kv.device)) is not None
        else:
            forward._fused_decode = lambda step: None  # the per-stage path
        return forward.forward(work)
    finally:
        cpu_kernels.set_enabled(enabled)


def _four_paths(kernels, preset: str, dtype: str, weights: str, synth_checkpoint):
    """A decode step's logits: (fused in one region, fused per operation, per stage, torch), and
    whether the model has q/k norms; skips where the fused call does not take the model."""
    from dualpace.model.loader import load_model

    loaded = load_model(str(synth_checkpoint(preset)), dtype=dtype, weights=weights)
    if not FusedDecode.applies(loaded.model, type("KV", (), {"device": torch.device("cpu"),
                                                               "dtype": loaded.model.dtype})(), kernels):
        pytest.skip("head_dim not covered by the fused kernels")
    fused = _decode_logits(loaded, fused=True, kernels_on=True)
    with one_region(kernels, False):
        fused_per_op = _decode_logits(loaded, fused=True, kernels_on=True)
    stages = _decode_logits(loaded, fused=False, kernels_on=True)
    reference = _decode_logits(loaded, fused=False, kernels_on=False)
    return (fused, fused_per_op, stages, reference), loaded.model.weights.layers[0].q_norm is not None


@pytest.mark.parametrize("dtype,weights", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-qwen3", "tiny-phi3"])
def test_fused_decode_step_matches_stages_and_torch(kernels, preset, dtype, weights, synth_checkpoint):
    """Also fp32 compute over bf16 matrices (what --dtype auto picks on a CPU without native bf16).
    The fused step runs as one parallel region (these short contexts) and as one region per
    operation: both equal the torch reference."""
    (fused, fused_per_op, stages, reference), _ = _four_paths(kernels, preset, dtype, weights, synth_checkpoint)
    rel = 1e-5 if dtype == "fp32" else 3e-2
    _close(fused, reference, rel)
    _close(fused_per_op, reference, rel)
    _close(stages, reference, rel)
    if dtype == "fp32":
        assert torch.equal(fused.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("dtype,weights", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_fused_moe_step_equals_stages(kernels, preset, dtype, weights, synth_checkpoint):
    """A MoE model's decode step in one call (the router, the routing and the selected experts
    inside the step, cpu_moe.h) gives bitwise the same logits in one region and per operation, and
    those of the per-stage path (route_on_kernels, then the grouped experts call) where that path
    has no torch op of its own (Qwen3's q/k norms are torch's there); the torch reference's within
    rounding."""
    (fused, fused_per_op, stages, reference), qk_norms = _four_paths(kernels, preset, dtype, weights,
                                                                     synth_checkpoint)
    assert torch.equal(fused_per_op, fused)
    if not qk_norms:
        assert torch.equal(fused, stages)
    rel = 1e-5 if dtype == "fp32" else 3e-2
    _close(stages, reference, rel)
    _close(fused, reference, rel)
    if dtype == "fp32":
        assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_one_region_setting_defaults_on_and_reports_the_previous(kernels):
    """dp_set_decode_one_region: on by default, each call returns the setting before it."""
    assert kernels.set_one_region(False) is True
    assert kernels.set_one_region(True) is False
    assert kernels.set_one_region(True) is True


@pytest.mark.parametrize("in_one_region", [True, False])
@pytest.mark.parametrize("dtype,weights", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
def test_fused_step_logits_equal_separate_lm_head(kernels, dtype, weights, in_one_region, synth_checkpoint):
    """The final norm and LM head folded into the step's call (dp_decode_step_*) give exactly the
    logits of the layers' call followed by Transformer.logits, in one region and per operation."""
    from dualpace.kv.storage import KVStorage
    from dualpace.model.loader import load_model
    from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors

    with one_region(kernels, in_one_region):
        loaded = load_model(str(synth_checkpoint("tiny-llama")), dtype=dtype, weights=weights)
        model, cfg = loaded.model, loaded.config
        kv = KVStorage(cfg.num_layers, 24, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        kv.k.normal_()
        kv.v.normal_()
        work = [SequenceWork([5 + i], 6 + 7 * i, list(range(8 * i, 8 * i + 8))) for i in range(3)]
        step = build_step_tensors(work, kv.block_size, kv.device)
        fused = PagedForward(model, kv)._fused_decode(step)
        if fused is None:
            pytest.skip("head_dim not covered by the fused kernels")
        with torch.inference_mode():
            rope = model.rope_angles(step.positions)
            args = (rope.cos, rope.sin, step.slot_ids, step.decode_block_tables, step.decode_context_lens)
            hidden = model.embed(step.token_ids)
            assert fused.head_applies(hidden)
            separate_hidden = hidden.clone()
            folded = fused.run(hidden, *args, with_logits=True)
            assert fused.run(separate_hidden, *args) is None
            separate = model.logits(separate_hidden)
    assert folded.dtype == torch.float32 and folded.shape == (3, cfg.vocab_size)
    assert torch.equal(hidden, separate_hidden)
    assert torch.equal(folded, separate)
