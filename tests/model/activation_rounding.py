"""How each activation mode of the quantized kernels rounds x, modelled in torch, so the kernel
tests can state the exact result of a mode or its error bound."""

from __future__ import annotations

import torch

from dualpace.model import quant_kernels


# How a mode rounds x: int16 (quant_gemv_i16.h) per two sets of 16 elements of each block of 32
# (elements 0-7 + 16-23 and 8-15 + 24-31) to +-32767; int8 (quant_gemv_vnni.h) per 16 consecutive
# elements to +-127.
INT16_SCHEME = (True, 32767)
INT8_SCHEME = (False, 127)
# int8 up to int8_k_max_rows() rows on the K-quant formats (quant_gemv_q8k.h): per super-block of 256
# consecutive elements to +-127; a call holding an outlier row computes in int16.
INT8_K_SCHEME = ("super-block", 127)
K_QUANT_FORMATS = ("Q4_K", "Q6_K")
# int8 up to int8_pairs_max_rows() rows on Q8_0 and Q4_0 (quant_gemv_block_pairs.h): per 16
# consecutive elements to +-127 (INT8_SCHEME without its outlier rows' second rounding); a call
# holding an outlier row computes in int16.
INT8_BLOCK_SCHEME = ("pairs", 127)
PAIR_FORMATS = ("Q8_0", "Q4_0")
# Elements per scale of the schemes that round consecutive runs (an outlier row: int16 instead).
RUN_ELEMS = {INT8_K_SCHEME: 256, INT8_BLOCK_SCHEME: 16}


def int16_halves(x: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """x [M, K] as [M, K / 32, 2, 16]: the two sets of 16 elements of each block that share a scale."""
    if not interleaved:
        return x.reshape(x.shape[0], -1, 2, 16)
    parts = x.reshape(x.shape[0], -1, 4, 8)
    return torch.stack([parts[:, :, 0::2].flatten(2), parts[:, :, 1::2].flatten(2)], 2)


def from_int16_halves(h: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    m, nb = h.shape[:2]
    if not interleaved:
        return h.reshape(m, nb * 32)
    parts = torch.empty(m, nb, 4, 8, dtype=h.dtype)
    parts[:, :, 0::2], parts[:, :, 1::2] = h[:, :, 0].reshape(m, nb, 2, 8), h[:, :, 1].reshape(m, nb, 2, 8)
    return parts.reshape(m, nb * 32)


def int16_rounded(x: torch.Tensor, rounding: tuple[bool, int] = INT16_SCHEME) -> torch.Tensor:
    """x rounded as the int16 (or int8) mode does (fp32 arithmetic: q = round(x * (qmax / max)), x = q max / qmax)."""
    interleaved, qmax = rounding
    h = int16_halves(x, interleaved)
    amax = h.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, float(qmax)) / amax, torch.zeros_like(amax))  # IEEE division
    return from_int16_halves(torch.round(h * inv).double() * (amax.double() / qmax), interleaved)


def int8_outliers(x: torch.Tensor) -> torch.Tensor:
    """The rows the int8 mode rounds twice (quant_gemv_vnni.h): max |x| above the library's ratio x rms."""
    ratio = quant_kernels.get().dp_quant_int8_outlier_ratio()
    xf = x.float()
    return xf.abs().amax(-1) ** 2 * x.shape[1] > ratio ** 2 * (xf * xf).sum(-1)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 mode rounds it: per 16 elements to int8, and for outlier rows that rounding
    plus its residual (x - dx q in one fp32 rounding, as the kernel's fma) rounded the same way."""
    out = int16_rounded(x, INT8_SCHEME)
    rows = int8_outliers(x)
    if rows.any():
        h = x[rows].float().reshape(-1, 16)
        amax = h.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        q = torch.round(h * inv)
        residual = (h.double() - q.double() * (amax / 127.0).double()).float().reshape(-1, x.shape[1])
        out[rows] += int16_rounded(residual, INT8_SCHEME)
    return out


def super_block_rounded(x: torch.Tensor, elems: int = 256) -> torch.Tensor:
    """x rounded per `elems` consecutive elements to int8, as INT8_K_SCHEME (256) or INT8_BLOCK_SCHEME
    (16) (fp32 q, double scale)."""
    g = x.reshape(x.shape[0], -1, elems)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(g * inv).double() * (amax.double() / 127)).reshape(x.shape)


def mode_rounded(x: torch.Tensor, rounding) -> torch.Tensor:
    if rounding in RUN_ELEMS:
        return int16_rounded(x) if int8_outliers(x).any() else super_block_rounded(x, RUN_ELEMS[rounding])
    return int8_rounded(x) if rounding == INT8_SCHEME else int16_rounded(x, rounding)


def int8_min_rows() -> int:
    """Rows of x from which the loaded standalone library's int8 mode runs int8 (0: never, no VNNI)."""
    return quant_kernels.get().dp_quant_int8_min_rows()


def int8_k_max_rows() -> int:
    """Rows of x up to which the loaded standalone library's int8 mode rounds K-quant calls per super-block."""
    return quant_kernels.get().dp_quant_int8_k_max_rows()


def int8_pairs_max_rows() -> int:
    """Rows of x up to which the loaded standalone library's int8 mode rounds Q8_0 / Q4_0 calls per block."""
    return quant_kernels.get().dp_quant_int8_pairs_max_rows()


def rounding_of(mode: str, m: int, name: str) -> tuple:
    """How `mode` rounds m rows of x for a matrix of format `name` (fp32: as int16 here; the callers
    compare it exactly)."""
    if mode != "int8" or not int8_min_rows():
        return INT16_SCHEME
    if name in K_QUANT_FORMATS and m <= int8_k_max_rows():
        return INT8_K_SCHEME
    if name in PAIR_FORMATS and m <= int8_pairs_max_rows():
        return INT8_BLOCK_SCHEME
    return INT8_SCHEME if m >= int8_min_rows() else INT16_SCHEME


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float = 1e-5,
                        rounding=INT16_SCHEME) -> None:
    """y = x @ w.T, except for the mode's rounding of x per 16 (or 256) elements (|error| <= half a
    step, max|x_group| / qmax / 2, per element: its bound through |w| is allowed on top of rel)."""
    if rounding in RUN_ELEMS and int8_outliers(x).any():
        rounding = INT16_SCHEME
    ref = x.double() @ w.double().T
    if rounding in RUN_ELEMS:
        g = x.double().reshape(x.shape[0], -1, RUN_ELEMS[rounding])
        half_step = (g.abs().amax(-1, keepdim=True) / 127 * 0.5 * (1 + 1e-3)).expand_as(g).reshape(x.shape)
    else:
        interleaved, qmax = rounding
        h = int16_halves(x.double(), interleaved)
        half_step = from_int16_halves((h.abs().amax(-1, keepdim=True) / qmax * 0.5 * (1 + 1e-3)).expand_as(h),
                                      interleaved)
    bound = half_step @ w.double().abs().T
    excess = ((y.double() - ref).abs() - bound).max().item()
    scale = ref.abs().max().item() + 1e-12
    assert excess <= rel * scale, excess / scale
