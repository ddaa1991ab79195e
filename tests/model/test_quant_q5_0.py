"""Q5_0 matrices (most of a Q4_K_M file of a model whose rows are not a multiple of 256) are held
as Q8_0 blocks with the same values (dualpace.model.quant.repack_q5_0_as_q8_0), so they run on
the Q8_0 kernel instead of being dequantized to fp32 at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from dualpace.errors import ModelLoadError
from dualpace.model import quant_kernels
from dualpace.model.quant import FORMAT_BY_NAME, Q5_0_GGML_TYPE, QuantizedWeight, repack_q5_0_as_q8_0


def q5_0_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    weights[0, :32] = 0.0  # an all-zero block (scale 0)
    weights[1, :32] = np.linspace(-1, 1, 32)  # both ends of the 5-bit range
    return np.asarray(quantize(weights, GGMLQuantizationType.Q5_0)).reshape(n, -1)


def test_the_type_id_is_ggml_q5_0():
    assert Q5_0_GGML_TYPE == int(GGMLQuantizationType.Q5_0)


@pytest.mark.parametrize("n,k", [(3, 32), (7, 576), (16, 1536)])
def test_repacked_blocks_hold_the_same_values(n, k):
    q5 = q5_0_blocks(n, k)
    q8 = repack_q5_0_as_q8_0(q5)
    assert q8.shape == (n, k // 32 * 34)
    expected = dequantize(q5, GGMLQuantizationType.Q5_0).reshape(n, k)
    got = dequantize(q8, GGMLQuantizationType.Q8_0).reshape(n, k)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(q8.reshape(n, -1, 34)[..., 2:].view(np.int8)).max() <= 16


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ModelLoadError, match="22-byte blocks"):
        repack_q5_0_as_q8_0(np.zeros((2, 23), dtype=np.uint8))


@pytest.mark.skipif(quant_kernels.get() is None, reason="quantized-weight kernels not built here")
def test_the_q8_0_kernel_on_repacked_blocks_matches_the_dense_product():
    n, k = 33, 576
    q5 = q5_0_blocks(n, k, seed=1)
    weight = QuantizedWeight.from_blocks(repack_q5_0_as_q8_0(q5), FORMAT_BY_NAME["Q8_0"], k)
    dense = torch.from_numpy(dequantize(q5, GGMLQuantizationType.Q5_0).reshape(n, k).copy())
    x = torch.randn(3, k)
    torch.testing.assert_close(weight.linear(x), x @ dense.T, rtol=2e-3, atol=2e-3)
