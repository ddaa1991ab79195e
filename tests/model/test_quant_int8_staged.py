"""The int8 mode's calls with more rows of x than one pass holds stage each block of W rows once
(quant_gemv_vnni_rows.h): their rows must equal, bitwise, the same rows run in calls of 16 (one
pass, W read as it is), in every block format, in the standalone kernels and the cpu_kernels seam."""

import pytest
import torch

from dualpace.model import cpu_kernels, quant_activations
from dualpace.model.quant import FORMAT_BY_NAME
from tests.model.activation_rounding import int8_min_rows
from tests.model.test_quant import FORMATS, needs_kernels, variant, weight  # noqa: F401 (fixture)

ROWS_PER_PASS = 64  # VNNI_MAX_GROUPS lane groups of 16


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_many_row_calls_equal_calls_of_one_pass(name, variant):  # noqa: F811
    quant_activations.set_activations("int8")
    try:
        if not int8_min_rows():
            pytest.skip(f"{variant} runs no int8 rows (no AVX-512 VNNI build)")
        kernels = cpu_kernels.get()
        seam = kernels is not None and kernels.supports_format(FORMAT_BY_NAME[name].ggml_type)
        for m, n, k in [(ROWS_PER_PASS + 16, 19, 512), (160, 37, 768)]:  # chunks of 16 rows: all lane groups
            qw, _ = weight(name, n, k, seed=m)
            x = torch.randn(m, k) * torch.rand(m, k) * 4
            x[m // 3, k // 5] = 80.0  # an outlier row: its residual lane lands in the last pass
            chunks = range(0, m, 16)
            assert torch.equal(qw.linear(x), torch.cat([qw.linear(x[i:i + 16]) for i in chunks]))
            if seam:
                assert torch.equal(kernels.linear(x, qw), torch.cat([kernels.linear(x[i:i + 16], qw) for i in chunks]))
    finally:
        quant_activations.set_activations("int16")
