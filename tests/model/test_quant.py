"""Block-quantized weights (dualpace.model.quant, quant_gemv.h): every format against the `gguf`
package's dequantization, odd N, K a multiple of the block, 1..70 rows of x, through the
standalone kernels, the torch fallback, the cpu_kernels seam, in each activation mode: int16 (the
exact mode: within the bound its rounding allows), fp32 (exact up to summation order) and int8
(from a few rows on AVX-512 VNNI: x rounded to int8 per 16 elements, the products exact; below
that on the K-quant formats per 256 elements), and in
every ISA variant this CPU runs
(avx512_bf16, avx512, avx2, generic; the others skipped by name): the AVX-512 builds have rows of
their own (quant_gemv_avx512.h)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from dualpace.errors import ModelLoadError
from dualpace.model import cpu_kernels, quant, quant_activations, quant_kernels
from dualpace.model.quant import FORMAT_BY_NAME, QuantizedWeight, cat_rows, quantize_q8_0
from tests.model.activation_rounding import (  # how each activation mode rounds x
    INT16_SCHEME,
    mode_rounded,
    rounding_of,
    assert_linear_close,
)
from tests.model.test_cpu_kernels import VARIANTS  # every variant, those this CPU lacks skipped by name

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]
SHAPES = [(1, 37, 256), (3, 19, 512), (8, 33, 768), (13, 5, 256), (70, 9, 512), (130, 7, 256), (5, 11, 96),
          (2, 17, 576)]  # K = 96, 576: a last quad of 3 / 2 blocks in the int16 kernel (32-element formats)
needs_kernels = pytest.mark.skipif(quant_kernels.get() is None, reason="quantized-weight kernels not built here")


def random_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes] of valid blocks: quantized random weights where the gguf package can
    quantize the format, else random bytes with finite, small fp16 scales (K-quants)."""
    rng = np.random.default_rng(seed)
    fmt = FORMAT_BY_NAME[name]
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        return np.asarray(quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, fmt.ggml_type)).reshape(n, -1)
    raw = rng.integers(0, 256, (n, k // 256, fmt.block_bytes), dtype=np.uint8)
    d = (rng.random((n, k // 256)) * 0.01 + 0.001).astype(np.float16)
    if name == "Q4_K":
        raw[..., 0:2] = d.view(np.uint8).reshape(n, k // 256, 2)
        raw[..., 2:4] = (d * 0.5).view(np.uint8).reshape(n, k // 256, 2)
    else:
        raw[..., 208:210] = d.view(np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1)


def reference(blocks: np.ndarray, name: str, k: int) -> torch.Tensor:
    values = dequantize(blocks, FORMAT_BY_NAME[name].ggml_type)
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(blocks.shape[0], k))


def weight(name: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    blocks = random_blocks(name, n, k, seed)
    return QuantizedWeight.from_blocks(blocks, FORMAT_BY_NAME[name], k), reference(blocks, name, k)


def assert_close(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    scale = ref.abs().max().item() + 1e-12
    assert (y - ref).abs().max().item() <= rel * scale, (y - ref).abs().max().item() / scale


@pytest.fixture(params=VARIANTS)
def variant(request):
    """One ISA variant for both libraries (the standalone quant kernels and cpu_kernels), the
    defaults restored after."""
    previous_quant, previous_cpu = quant_kernels._state.get("lib", False), cpu_kernels._state.copy()
    if quant_kernels.select_variant(request.param) is None or cpu_kernels.select_variant(request.param) is None:
        pytest.fail(f"variant {request.param} did not build or load (see the log)")
    yield request.param
    if previous_quant is False:
        quant_kernels._state.pop("lib", None)
    else:
        quant_kernels._state["lib"] = previous_quant
    cpu_kernels._state.clear()
    cpu_kernels._state.update(previous_cpu)


def fp32_from_rows() -> int:
    """Rows of x from which the loaded standalone library's int16 mode computes in fp32 (0: never)."""
    return quant_kernels.get().dp_quant_fp32_min_rows()


@pytest.fixture(params=["int16", "fp32", "int8"])
def activations(request, variant):
    """Each activation mode of the kernels for one test, the default (int16) restored after."""
    quant_activations.set_activations(request.param)
    yield request.param
    quant_activations.set_activations("int16")


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_linear_matches_dequantized_reference(name, m, n, k, activations):
    if k % FORMAT_BY_NAME[name].block_elems:
        pytest.skip(f"{name} needs K a multiple of {FORMAT_BY_NAME[name].block_elems}")
    qw, w = weight(name, n, k)
    x = torch.randn(m, k) * torch.rand(m, k) * 4  # blocks of different scales
    if activations == "fp32":
        assert_close(qw.linear(x), x @ w.T)
    else:
        assert_linear_close(qw.linear(x), x, w, rounding=rounding_of(activations, m, name))
    bias = torch.randn(n)
    assert_linear_close(qw.linear(x, bias) - bias, x, w, rounding=rounding_of(activations, m, name))


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_and_embedding_are_exact(name, variant):
    qw, w = weight(name, 23, 512)
    assert torch.equal(qw.dequantize(), w)
    ids = torch.tensor([[0, 22], [11, 0]])
    assert torch.equal(qw.embedding(ids), w[ids])
    assert torch.equal(torch.nn.functional.embedding(ids, qw), w[ids])
    with pytest.raises(IndexError):
        qw.embedding(torch.tensor([23]))


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_torch_fallback_without_kernels(name, monkeypatch):
    qw, w = weight(name, 11, 256)
    monkeypatch.setattr(quant_kernels, "get", lambda: None)
    x = torch.randn(3, 256)
    assert_close(qw.linear(x), x @ w.T)
    assert torch.equal(qw.embedding(torch.tensor([4])), w[[4]])
    assert torch.equal(qw.dequantize(), w)


@needs_kernels
def test_mixed_formats_fuse_into_segments():
    (a, wa), (b, wb), (c, wc) = weight("Q4_K", 9, 512, 1), weight("Q4_K", 5, 512, 2), weight("Q6_K", 7, 512, 3)
    dense = torch.randn(3, 512)
    fused = cat_rows([a, b, c, dense])
    assert fused.shape == (24, 512) and fused.formats == ["Q4_K", "Q6_K", "F32"]
    assert fused.kernel_desc() is None  # no single layout: the fused kernels leave it to linear()
    x = torch.randn(4, 512)
    assert_linear_close(fused.linear(x), x, torch.cat([wa, wb, wc, dense]))
    assert fused.num_bytes() == a.num_bytes() + b.num_bytes() + c.num_bytes() + dense.numel() * 4


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_formats_run_in_the_kernels_run_by_run(dtype, variant):
    """A Q4_K_M file's qkv (Q4_K rows, then Q6_K rows): Kernels.linear runs each run of rows in
    the kernels, into its columns of one output, bias and residual sliced to them: as each run's
    own kernel product. A dense run leaves the whole product to torch."""
    kernels = cpu_kernels.get()
    if kernels is None or not kernels.supports_format(FORMAT_BY_NAME["Q6_K"].ggml_type):
        pytest.skip("no CPU kernels for the block formats")
    (a, _), (c, _) = weight("Q4_K", 9, 512, 1), weight("Q6_K", 7, 512, 3)
    fused = cat_rows([a, c])
    assert kernels._segment_descs(torch.randn(2, 512), fused) is not None
    assert kernels._segment_descs(torch.randn(2, 512), cat_rows([a, torch.randn(3, 512)])) is None
    x, bias, residual = torch.randn(5, 512, dtype=dtype), torch.randn(16, dtype=dtype), torch.randn(5, 16, dtype=dtype)
    y = kernels.linear(x, fused, bias, residual=residual, out_dtype=torch.float32)
    parts = [kernels.linear(x, a, bias[:9], residual=residual[:, :9], out_dtype=torch.float32),
             kernels.linear(x, c, bias[9:], residual=residual[:, 9:], out_dtype=torch.float32)]
    assert torch.equal(y, torch.cat(parts, 1))


@needs_kernels
def test_prefill_sized_linear_goes_through_the_scratch_in_pieces(monkeypatch):
    """From DENSE_MIN_ROWS rows: each piece of W dequantized into the reused scratch (7 rows a
    piece here, so segments end mid-piece), bias and residual added by the GEMM, mixed segments."""
    monkeypatch.setattr(quant, "SCRATCH_MAX_ELEMS", 7 * 512)
    (a, wa), (c, wc) = weight("Q4_K", 9, 512, 1), weight("Q6_K", 12, 512, 3)
    dense = torch.randn(3, 512)
    fused, w = cat_rows([a, c, dense]), torch.cat([wa, wc, dense])
    m = quant.DENSE_MIN_ROWS + 3
    x, bias, residual = torch.randn(m, 512), torch.randn(24), torch.randn(m, 24)
    first = fused.linear(x)
    assert_close(first, x @ w.T)
    assert_close(fused.linear(x, bias), x @ w.T + bias)
    assert_close(fused.linear(x, residual=residual), x @ w.T + residual)
    assert_close(fused.linear(x, bias, residual=residual), x @ w.T + bias + residual)
    assert_close(first, x @ w.T)  # a result never aliases the scratch
    y = fused.linear(x.view(1, m, 512).to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (1, m, 24)


@needs_kernels
def test_torch_functions_and_to():
    qw, w = weight("Q4_1", 16, 256)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    y = torch.nn.functional.linear(x, qw.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 16)
    assert qw.to(dtype=torch.bfloat16).dtype == torch.bfloat16 and qw.to("cpu").device.type == "cpu"
    desc = qw.kernel_desc()
    assert desc[0] == 3 and desc[2:] == (16, 256, 256 // 32 * 20)


def test_bad_blocks_are_refused():
    with pytest.raises(ModelLoadError):
        QuantizedWeight.from_blocks(np.zeros((4, 19), dtype=np.uint8), FORMAT_BY_NAME["Q4_1"], 32)
    with pytest.raises(ModelLoadError):
        quantize_q8_0(torch.randn(4, 40))


@needs_kernels
def test_int8_quantization_at_load_is_q8_0(variant):
    w = torch.randn(17, 96)
    qw = quantize_q8_0(w)
    assert qw.formats == ["Q8_0"]
    assert (qw.dequantize() - w).abs().max() <= w.abs().max() / 127  # half a step of the block scale
    x = torch.randn(5, 96)
    assert_linear_close(qw.linear(x), x, qw.dequantize())


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_the_cpu_kernels_seam_uses_the_header(name, activations):
    """Kernels.linear (cpu_kernels.cpp's linear_any, which includes quant_gemv.h) on the same weight."""
    kernels = cpu_kernels.get()
    if kernels is None or not kernels.supports_format(FORMAT_BY_NAME[name].ggml_type):
        pytest.skip("cpu_kernels without quantized formats here")
    qw, w = weight(name, 21, 512)
    for m in (1, 5, 8, 20, quant.DENSE_MIN_ROWS):
        x = torch.randn(m, 512)
        residual = torch.randn(m, 21)
        y = kernels.linear(x, qw, residual=residual)
        if activations == "fp32":
            assert_close(y, x @ w.T + residual)
        else:
            assert_linear_close(y - residual, x, w, rounding=rounding_of(activations, m, name))


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_1_chunks_read_in_two_streams(name, threads, activations):
    """At batch 1 a chunk of >= 64 W rows is read as its two halves alternating (quant_gemv_i16.h,
    rows_two_streams): 261 rows make chunks of 132 + 129 rows on one thread (an odd one, its last
    row read on its own) and of 64 + ... + 5 on two."""
    kernels = cpu_kernels.get()
    if kernels is None or not kernels.supports_format(FORMAT_BY_NAME[name].ggml_type):
        pytest.skip("cpu_kernels without quantized formats here")
    qw, w = weight(name, 261, 256)
    x = torch.randn(1, 256)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernels.linear(x, qw)
    finally:
        torch.set_num_threads(before)
    if activations == "fp32":
        assert_close(y, x @ w.T)
    else:
        assert_linear_close(y, x, w, rounding=rounding_of(activations, 1, name))


@needs_kernels
@pytest.mark.parametrize("mode", ["int16", "int8"])
@pytest.mark.parametrize("name", FORMATS)
def test_integer_modes_are_the_rounded_activations_times_the_weights(name, mode, variant):
    """int16 (the exact mode) equals x rounded per 16 elements times the dequantized weights, int8
    from int8_min_rows() rows x rounded to int8 per 16, up to fp32 summation order: the min terms
    use the rounded sums, nothing else is approximated (the integer products are exact). AVX-512
    builds of the standalone library compute int16 from fp32_from_rows() rows of x on with the fp32
    activations (exact)."""
    kernels = cpu_kernels.get()
    quant_activations.set_activations(mode)
    from_rows = fp32_from_rows()
    try:
        for m, n, k in [(1, 37, 256), (4, 9, 256), (5, 19, 512), (7, 11, 256), (8, 13, 256), (9, 6, 256),
                        (16, 7, 256), (33, 8, 768), (127, 5, 256)]:
            qw, w = weight(name, n, k)
            x = torch.randn(m, k) * torch.rand(m, k) * 4
            x[m // 2] *= 0.01
            x[m // 2, k // 3] = 50.0  # an outlier row from K = 512 (int8: rounded twice)
            rounding = rounding_of(mode, m, name)
            rounded = mode_rounded(x, rounding) @ w.double().T
            exact = from_rows and m >= from_rows and rounding == INT16_SCHEME
            assert_close(qw.linear(x).double(), x.double() @ w.double().T if exact else rounded, rel=1e-6)
            if kernels is not None and kernels.supports_format(FORMAT_BY_NAME[name].ggml_type):
                # the engine's kernels keep the integer arithmetic at every batch for fp32 x (batch
                # invariance: dp_quant::prepare's fp32_switch is for bf16 compute only)
                assert_close(kernels.linear(x, qw).double(), rounded, rel=1e-6)
    finally:
        quant_activations.set_activations("int16")


@needs_kernels
def test_each_variant_builds_the_rows_it_names(variant):
    """AVX-512 builds (avx512, avx512_bf16, and generic where -march=native has AVX-512) run the
    512-bit rows and switch the int16 mode to fp32 from 8 rows; AVX2 builds never switch. The int8
    rows exist in builds with AVX-512 VNNI (avx512_bf16)."""
    lib = quant_kernels.get()
    bits, from_rows = lib.dp_quant_vector_bits(), lib.dp_quant_fp32_min_rows()
    if variant == "avx512_bf16":
        assert lib.dp_quant_int8_min_rows() == 5
    elif variant in ("avx512", "avx2"):
        assert lib.dp_quant_int8_min_rows() == 0
    if variant.startswith("avx512"):
        assert (bits, from_rows) == (512, 8)
    elif variant == "avx2":
        assert (bits, from_rows) == (256, 0)
    else:
        assert bits in (0, 256, 512) and from_rows == (8 if bits == 512 else 0)
