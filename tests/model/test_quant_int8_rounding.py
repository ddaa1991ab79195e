"""The int8 mode's rounding at its edges (quant_gemv_vnni.h, quant_gemv_q8k.h,
quant_gemv_block_pairs.h): outlier rows keep their small channels, few-row calls round per run
(256 on the K-quants, 16 on Q8_0 / Q4_0) unless a row is an outlier, and the integer sums hold at
the extremes of the weights and activations."""

import numpy as np
import pytest
import torch

from dualpace.model import cpu_kernels, quant_activations
from dualpace.model.quant import FORMAT_BY_NAME, QuantizedWeight
from tests.model.activation_rounding import (
    INT8_SCHEME,
    K_QUANT_FORMATS,
    PAIR_FORMATS,
    RUN_ELEMS,
    int16_rounded,
    int8_min_rows,
    int8_outliers,
    mode_rounded,
    rounding_of,
    super_block_rounded,
)
from tests.model.test_quant import (  # noqa: F401 (variant: a fixture)
    assert_close,
    fp32_from_rows,
    needs_kernels,
    reference,
    variant,
    weight,
)


@needs_kernels
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])
def test_int8_outlier_rows_keep_their_small_channels(name, variant):
    """A row whose few channels stand far above the rest (a chat prompt's special tokens) loses
    its small channels to int8 rounding per 16; the int8 mode rounds it twice, so its error stays
    within max / 254^2 per element (about int16's), while ordinary rows of the same call keep int8."""
    if not int8_min_rows():
        pytest.skip(f"{variant} runs no int8 rows (no AVX-512 VNNI build)")
    torch.manual_seed(7)
    n, k, m = 24, 2048, 12
    qw, w = weight(name, n, k)
    x = torch.randn(m, k)
    x[3, ::97] *= 400.0  # 22 channels far above the rest
    assert int8_outliers(x).tolist() == [i == 3 for i in range(m)]
    quant_activations.set_activations("int8")
    try:
        y = qw.linear(x).double()
    finally:
        quant_activations.set_activations("int16")
    ref = x.double() @ w.double().T
    blocks = x.double().reshape(m, -1, 16).abs().amax(-1, keepdim=True).expand(m, k // 16, 16).reshape(m, k)
    two_level = (blocks / 254 ** 2 * (1 + 1e-3)) @ w.double().abs().T
    one_level = (blocks / 254 * (1 + 1e-3)) @ w.double().abs().T
    assert ((y - ref).abs()[3] <= two_level[3] + 1e-5 * ref.abs().max()).all()
    assert ((y - ref).abs() <= one_level + 1e-5 * ref.abs().max()).all()
    rounded_once = int16_rounded(x[3:4], INT8_SCHEME) @ w.double().T
    assert (y[3] - ref[3]).abs().max() < 0.05 * (rounded_once - ref[3]).abs().max()


@needs_kernels
@pytest.mark.parametrize("name,m,k", [(n, 3, 512) for n in K_QUANT_FORMATS] + [(n, m, k) for n in PAIR_FORMATS
                                                                            for m, k in ((1, 544), (3, 512), (8, 608))])
def test_int8_few_rows_round_per_run_unless_a_row_is_an_outlier(name, m, k, variant):
    """Up to a few rows the int8 mode rounds a K-quant call's rows per 256 elements
    (quant_gemv_q8k.h) and a Q8_0 / Q4_0 call's per 16 (quant_gemv_block_pairs.h: K = 544 and 608
    leave a last block without its pair); a call holding an outlier row, whose small channels
    that rounding would flatten, computes in int16 instead, every row of it (fp32 from the
    standalone library's fp32_from_rows())."""
    if not int8_min_rows():
        pytest.skip(f"{variant} runs no int8 rows (no AVX-512 VNNI build)")
    torch.manual_seed(3)
    qw, w = weight(name, 29, k)
    x = torch.randn(m, k)
    spiked = x.clone()
    spiked[m // 2, 40] = 400.0  # one channel far above the rest
    assert int8_outliers(spiked).tolist() == [i == m // 2 for i in range(m)]
    quant_activations.set_activations("int8")
    try:
        plain, with_outlier = qw.linear(x).double(), qw.linear(spiked).double()
    finally:
        quant_activations.set_activations("int16")
    rounding = rounding_of("int8", m, name)
    assert rounding in RUN_ELEMS
    per_run, per_16 = super_block_rounded(x, RUN_ELEMS[rounding]) @ w.double().T, int16_rounded(x) @ w.double().T
    assert_close(plain, per_run, rel=1e-6)
    assert (per_run - per_16).abs().max() > 1e-4 * per_16.abs().max()  # the two roundings differ here
    exact = spiked if 0 < fp32_from_rows() <= m else int16_rounded(spiked)
    assert_close(with_outlier, exact.double() @ w.double().T, rel=1e-6)


@needs_kernels
def test_int8_mode_at_the_extremes(variant):
    """int8 on Q8_0: every int8 weight (-128 and 127 included; rows all 127 and all -128) against
    activation blocks at +max and -max (q = +-127), all-zero blocks (scale 0) and rows past the
    last full lane group: the integer sums neither overflow nor lose their -128 starts, in the offset
    form (w + 128 against q, up to 32 lanes) and the signed one (q + 128 against w, from 33)."""
    if not int8_min_rows():
        pytest.skip(f"{variant} runs no int8 rows (no AVX-512 VNNI build): int8 mode is its int16/fp32 path")
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    n, k = 24, 1024
    raw = np.zeros((n, k // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = (rng.random((n, k // 32)) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    q = rng.integers(-128, 128, (n, k // 32, 32)).astype(np.int8)
    q[:4] = np.array([127, -128], dtype=np.int8)[np.arange(4) % 2][:, None, None]
    raw[:, :, 2:] = q.view(np.uint8)
    blocks = raw.reshape(n, -1)
    qw = QuantizedWeight.from_blocks(blocks, FORMAT_BY_NAME["Q8_0"], k)
    w = reference(blocks, "Q8_0", k)
    kernels = cpu_kernels.get()
    quant_activations.set_activations("int8")
    try:
        for m in (5, 17, 32, 40):
            x = torch.randn(m, k)
            x[0, :512], x[1, :512] = 3.0, -3.0
            x[2, 32:64] = 0.0
            ref = mode_rounded(x, rounding_of("int8", m, "Q8_0")) @ w.double().T
            assert_close(qw.linear(x).double(), ref, rel=1e-6)
            if kernels is not None and kernels.supports_format(FORMAT_BY_NAME["Q8_0"].ggml_type):
                assert_close(kernels.linear(x, qw).double(), ref, rel=1e-6)
    finally:
        quant_activations.set_activations("int16")
