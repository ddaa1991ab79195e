"""The AMX-BF16 tiles of the CPU kernels (avx512_bf16 variant, CPUs with amx_bf16; skipped by name
elsewhere) against torch and against the GEMV."""

from __future__ import annotations

import pytest
import torch

from dualpace.model import cpu_kernels
from dualpace.model import cpu_kernels_build as kbuild
from tests.model.test_cpu_kernels import _SUPPORTED, _close, one_region

# -- AMX-BF16 tiles (avx512_bf16 variant, CPUs with amx_bf16; skipped by name elsewhere) ---------

_AMX_CPU = "amx_bf16" in kbuild.cpu_flags() and "avx512_bf16" in _SUPPORTED
amx_only = pytest.mark.skipif(not _AMX_CPU, reason="this CPU lacks amx_bf16 (or avx512_bf16)")


@pytest.fixture
def amx_kernels():
    """The avx512_bf16 kernels with AMX tiles on, from 1 row of x (restored afterwards)."""
    previous = cpu_kernels._state.copy()
    loaded = cpu_kernels.select_variant("avx512_bf16")
    if loaded is None or not loaded.set_amx(True):
        pytest.fail("avx512_bf16 kernels without AMX tiles on an amx_bf16 CPU (tile data not permitted?)")
    min_rows = loaded.lib.dp_amx_min_rows(1)
    yield loaded
    loaded.lib.dp_amx_min_rows(min_rows)
    loaded.set_amx(True)
    cpu_kernels._state.clear()
    cpu_kernels._state.update(previous)


def _linear_c(kernels, x, w, bias=None, residual=None, out_dtype=torch.float32):
    """dp_linear_bf16 called directly (any number of rows, no routing by Kernels.linear)."""
    import ctypes

    desc = cpu_kernels.weight_desc(w)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype)
    status = kernels.lib.dp_linear_bf16(x.data_ptr(), x.shape[0], x.stride(0), ctypes.byref(desc),
                                        None if bias is None else bias.data_ptr(),
                                        None if residual is None else residual.data_ptr(),
                                        0 if residual is None else residual.stride(0), out.data_ptr(), w.shape[0],
                                        1 if out_dtype == torch.float32 else 0)
    assert status == 0
    return out


@amx_only
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 17, 31, 32, 33, 64, 100])
@pytest.mark.parametrize("n,k", [(37, 576), (64, 64), (48, 1536), (29, 100), (96, 32)])
def test_amx_linear_matches_torch_and_gemv(amx_kernels, rows, n, k):
    """AMX tiles (K % 32 == 0; k = 100 falls back to the GEMV) against fp32 math and against the
    vdpbf16ps GEMV, with bias and residual, fp32 and bf16 outputs; W row counts not multiples of
    16 (their last rows on the GEMV), x rows not multiples of 16 (the packed tiles zero-padded)."""
    torch.manual_seed(rows * 7 + n + k)
    x_full = torch.randn(rows, k + 8).bfloat16()
    x = x_full[:, 3:3 + k]  # rows k + 8 apart, not 64-byte aligned
    w, bias, residual = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16(), torch.randn(rows, n).bfloat16()
    expected = x.float() @ w.float().t() + bias.float() + residual.float()
    amx = _linear_c(amx_kernels, x, w, bias, residual)
    _close(amx, expected, 1e-5)
    _close(_linear_c(amx_kernels, x, w, bias, residual, torch.bfloat16), expected, 1e-2)
    _close(_linear_c(amx_kernels, x, w), x.float() @ w.float().t(), 1e-5)
    assert amx_kernels.set_amx(False) is False
    gemv = _linear_c(amx_kernels, x, w, bias, residual)
    amx_kernels.set_amx(True)
    _close(amx, gemv, 1e-5)


@amx_only
@pytest.mark.parametrize("rows", [4, 12, 32])
def test_amx_fp32_activations_never_use_tiles(amx_kernels, rows):
    """fp32 x over bf16 or fp32 matrices is the fp32 FMA GEMV whether AMX is on or off (bitwise)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 576)
    for w in (torch.randn(40, 576).bfloat16(), torch.randn(40, 576)):
        on = amx_kernels.linear(x, w)
        amx_kernels.set_amx(False)
        off = amx_kernels.linear(x, w)
        amx_kernels.set_amx(True)
        assert torch.equal(on, off)
        _close(on, x.double() @ w.double().t(), 1e-5)


@amx_only
def test_amx_routing_rows(amx_kernels):
    """bf16 x bf16: the kernels up to AMX_MAX_ROWS rows with AMX on, BF16_DOT_MAX_ROWS (the vdpbf16ps
    GEMV) without."""
    x_dtype = torch.bfloat16
    w = torch.randn(48, 64).bfloat16()
    assert amx_kernels.dense_max_rows(x_dtype) == cpu_kernels.AMX_MAX_ROWS
    assert amx_kernels.linear_desc(torch.zeros(cpu_kernels.AMX_MAX_ROWS, 64, dtype=x_dtype), w) is not None
    assert amx_kernels.linear_desc(torch.zeros(cpu_kernels.AMX_MAX_ROWS + 1, 64, dtype=x_dtype), w) is None
    amx_kernels.set_amx(False)
    assert amx_kernels.dense_max_rows(x_dtype) == cpu_kernels.BF16_DOT_MAX_ROWS
    assert amx_kernels.linear_desc(torch.zeros(cpu_kernels.BF16_DOT_MAX_ROWS + 1, 64, dtype=x_dtype), w) is None


@amx_only
@pytest.mark.parametrize("in_one_region", [True, False])
@pytest.mark.parametrize("batch", [3, 12, 32])
def test_amx_fused_decode_step_matches_gemv_and_torch(amx_kernels, batch, in_one_region, synth_checkpoint):
    """The fused bf16 decode step with its matrices and LM head on AMX tiles (from 1 row here)
    against the same step without AMX (the GEMV; above BF16_DOT_MAX_ROWS the per-operation path on
    oneDNN) and against torch, batches up to AMX_MAX_ROWS."""
    from dualpace.kv.storage import KVStorage
    from dualpace.model.loader import load_model
    from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors

    loaded = load_model(str(synth_checkpoint("tiny-mistral")), dtype="bf16", weights="bf16")  # head_dim 32
    model, cfg = loaded.model, loaded.config
    torch.manual_seed(batch)
    kv = KVStorage(cfg.num_layers, 4 * batch, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    kv.k.copy_(torch.randn_like(kv.k, dtype=torch.float32))
    kv.v.copy_(torch.randn_like(kv.v, dtype=torch.float32))
    work = [SequenceWork([5 + i], 3 + (5 * i) % 13, list(range(4 * i, 4 * i + 4))) for i in range(batch)]

    def logits(amx: bool, kernels_on: bool = True) -> torch.Tensor:
        amx_kernels.set_amx(amx)
        cpu_kernels.set_enabled(kernels_on)
        try:
            forward = PagedForward(model, kv)
            fused = forward._fused_decode(build_step_tensors(work, kv.block_size, kv.device))
            # without AMX, bf16 steps above BF16_DOT_MAX_ROWS run per operation (oneDNN's GEMMs)
            assert (fused is not None) == (kernels_on and (amx or batch <= cpu_kernels.BF16_DOT_MAX_ROWS))
            with one_region(amx_kernels, in_one_region):
                return forward.forward(work)
        finally:
            cpu_kernels.set_enabled(True)

    kv_k, kv_v = kv.k.clone(), kv.v.clone()
    on = logits(True)
    kv.k.copy_(kv_k)
    kv.v.copy_(kv_v)
    off = logits(False)
    kv.k.copy_(kv_k)
    kv.v.copy_(kv_v)
    reference = logits(True, kernels_on=False)
    _close(on, off, 3e-2)
    _close(on, reference, 3e-2)
