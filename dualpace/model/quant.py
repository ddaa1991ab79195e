"""Weight matrices kept in GGUF block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; Q5_0 as Q8_0) in host memory.

A QuantizedWeight is W [N, K] (y = x W^T) stored as the file's raw blocks, one uint8 row of
`row_bytes` per output row, so row operations (llama.cpp's Q/K un-permute, concatenating Q, K, V
into one fused matrix) are byte copies. A fused matrix whose parts have different formats (e.g.
Q4_K q/k with a Q6_K v in a Q4_K_M file) keeps one segment per run of rows of one format; dense
fp32 segments are allowed too (a tensor the file stores as F32/F16).

It satisfies the weight-object protocol of dualpace/model/KERNELS.md (`shape`, `kernel_desc()`,
`linear()`, `num_bytes()`), and implements `__torch_function__` for `F.linear` and `F.embedding`,
so the model's torch stages take it where they take a tensor. `dtype` is the compute dtype (of
the activations and results), not the storage; `device` is always the CPU: `.to("cuda", dtype)`
returns a dense tensor (weights dequantized at load on a GPU).

linear(): up to DENSE_MIN_ROWS rows of x (any number in the int8 activation mode on a CPU with
AVX-512 VNNI: dense_min_rows), the kernels of quant_kernels.cpp (quant_gemv.h); from
DENSE_MIN_ROWS rows (prefill), the matrix is dequantized
(AVX2, threaded) into a per-thread fp32 scratch that is reused from call to call (no fresh pages
to fault in: a fresh 7 MB buffer cost ~18x the dequantization itself) and multiplied with torch's
GEMM (MKL) straight into the result, bias or residual added by the GEMM (addmm). That is faster
there (the dequantization is 1/M of the multiply's work) and computes the same values. A matrix
larger than the scratch (the LM head, for all-position logits) goes through it in row pieces.
Without the kernels the torch fallback dequantizes with the `gguf` package per call (correct,
slow: the loader dequantizes at load instead when the kernels are off).

`quantize_q8_0` makes Q8_0 (symmetric int8 per group of 32 along K, fp16 scale) from a dense
matrix: `--weights int8` for a checkpoint without quantized tensors.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dualpace.errors import ModelLoadError
from dualpace.model import quant_kernels

# Rows of x from which linear() dequantizes the matrix for torch's GEMM (prefill-sized calls).
DENSE_MIN_ROWS = 128
# fp32 elements of the per-thread scratch a prefill-sized linear() dequantizes into (16 MiB: every
# projection of a 0.5-7B model's layer in one piece; larger matrices in pieces of rows).
SCRATCH_MAX_ELEMS = 1 << 22
_scratch = threading.local()


def dense_min_rows() -> int:
    """DENSE_MIN_ROWS, or never where the kernels multiply in int8 (the int8 mode on a CPU with AVX-512
    VNNI: 1.2-1.7x the dequantized matrix through torch's GEMM at 128 and 512 rows of 1B-sized
    Q8_0 and Q4_K matrices on an Intel Xeon, one thread)."""
    lib = quant_kernels.get()
    int8 = lib is not None and quant_kernels.activation_mode_id() == quant_kernels.ACTIVATION_MODES["int8"]
    return sys.maxsize if int8 and lib.dp_quant_int8_min_rows() > 0 else DENSE_MIN_ROWS


def _dequantize_scratch(num_elems: int) -> torch.Tensor:
    """This thread's fp32 scratch, at least `num_elems` long (kept for the next call)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < num_elems:
        buf = torch.empty(num_elems, dtype=torch.float32)
        _scratch.buf = buf
    return buf[:num_elems]


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # GGML's type id, the WeightFormat of kernel_weights.h
    block_elems: int
    block_bytes: int


FORMATS = {f.ggml_type: f for f in (
    BlockFormat("Q4_0", 2, 32, 18),
    BlockFormat("Q4_1", 3, 32, 20),
    BlockFormat("Q8_0", 8, 32, 34),
    BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q6_K", 14, 256, 210),
)}
FORMAT_BY_NAME = {f.name: f for f in FORMATS.values()}


@dataclass
class Segment:
    """Rows [row0, row0 + rows) of the matrix: raw blocks (format set) or a dense fp32 tensor."""

    row0: int
    blocks: torch.Tensor  # uint8 [rows, row_bytes], or float32 [rows, K] when format is None
    format: BlockFormat | None
    desc: quant_kernels.WeightDescC | None = None

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def kernel_desc(self, k: int) -> tuple[int, int, int, int, int]:
        return (self.format.ggml_type, self.blocks.data_ptr(), self.rows, k, self.blocks.shape[1])

    def dequantize(self, k: int, row0: int = 0, rows: int | None = None) -> torch.Tensor:
        """Float32 [rows, K] of rows [row0, row0 + rows) of the segment."""
        rows = self.rows - row0 if rows is None else rows
        if self.format is None:
            return self.blocks[row0:row0 + rows]
        lib = quant_kernels.get()
        if lib is not None and self.desc is not None:
            out = torch.empty((rows, k), dtype=torch.float32)
            if lib.dp_quant_dequantize_range(ctypes.byref(self.desc), row0, rows, out.data_ptr()) == 0:
                return out
        return Segment(0, self.blocks[row0:row0 + rows], self.format)._gguf_dequantize(k)

    def _gguf_dequantize(self, k: int) -> torch.Tensor:
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), self.format.ggml_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.rows, k))


class QuantizedWeight:
    """W [N, K] in block formats on the CPU. See the module docstring."""

    def __init__(self, segments: list[Segment], k: int, compute_dtype: torch.dtype = torch.float32):
        self.segments = segments
        self.k = k
        self.n = sum(s.rows for s in segments)
        self.compute_dtype = compute_dtype
        for seg in segments:
            if seg.format is not None:
                fmt, data_ptr, rows, cols, row_bytes = seg.kernel_desc(k)
                seg.desc = quant_kernels.WeightDescC(fmt, 0, data_ptr, rows, cols, row_bytes)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_blocks(cls, blocks: np.ndarray | torch.Tensor, fmt: BlockFormat, k: int) -> QuantizedWeight:
        """From a uint8 [N, row_bytes] array of raw blocks (copied into owned memory)."""
        data = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True)) if isinstance(blocks, np.ndarray) \
            else blocks.to(torch.uint8).contiguous()
        if k % fmt.block_elems or data.dim() != 2 or data.shape[1] != k // fmt.block_elems * fmt.block_bytes:
            raise ModelLoadError(f"{fmt.name} weight of shape [{data.shape[0]}, {k}]: rows of "
                                 f"{tuple(data.shape[1:])} bytes do not hold {k} elements in {fmt.name} blocks")
        return cls([Segment(0, data, fmt)], k)

    @classmethod
    def cat_rows(cls, parts: list[QuantizedWeight | torch.Tensor]) -> QuantizedWeight:
        """Rows of `parts` one after another (same K); runs of one format are merged."""
        k = parts[0].shape[1]
        if any(p.shape[1] != k for p in parts):
            raise ModelLoadError("cannot fuse weights with different input sizes")
        pieces: list[tuple[BlockFormat | None, torch.Tensor]] = []
        for part in parts:
            if isinstance(part, QuantizedWeight):
                pieces.extend((s.format, s.blocks) for s in part.segments)
            else:
                pieces.append((None, part.to(torch.float32).contiguous()))
        segments: list[Segment] = []
        row0 = 0
        i = 0
        while i < len(pieces):
            j = i
            while j + 1 < len(pieces) and pieces[j + 1][0] == pieces[i][0]:
                j += 1
            blocks = torch.cat([p[1] for p in pieces[i:j + 1]]) if j > i else pieces[i][1]
            segments.append(Segment(row0, blocks, pieces[i][0]))
            row0 += blocks.shape[0]
            i = j + 1
        dtypes = [p.compute_dtype for p in parts if isinstance(p, QuantizedWeight)]
        return cls(segments, k, dtypes[0] if dtypes else torch.float32)

    # -- the weight-object protocol -------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dense_min_rows(self) -> int:
        """From this many rows of x, linear() beats the kernels' per-call path (cpu_kernels asks)."""
        return dense_min_rows()

    @property
    def formats(self) -> list[str]:
        return [s.format.name if s.format else "F32" for s in self.segments]

    def kernel_desc(self) -> tuple[int, int, int, int, int] | None:
        """(format, data_ptr, N, K, row_bytes), or None when the rows mix formats."""
        if len(self.segments) != 1 or self.segments[0].format is None:
            return None
        return self.segments[0].kernel_desc(self.k)

    def num_bytes(self) -> int:
        return sum(s.blocks.numel() * s.blocks.element_size() for s in self.segments)

    def to(self, device: torch.device | str | torch.dtype | None = None, dtype: torch.dtype | None = None):
        """On the CPU: the same blocks with compute dtype `dtype`; elsewhere a dense tensor."""
        if isinstance(device, torch.dtype):  # .to(dtype)
            device, dtype = None, device
        if device is not None and torch.device(device).type != "cpu":
            return self.dequantize().to(device=device, dtype=dtype or self.compute_dtype)
        return QuantizedWeight(self.segments, self.k, dtype or self.compute_dtype)

    def contiguous(self) -> QuantizedWeight:
        return self

    def dequantize(self) -> torch.Tensor:
        """Float32 [N, K]."""
        return torch.cat([s.dequantize(self.k) for s in self.segments])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias) (+ residual [..., N]), in x.dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k).to(torch.float32).contiguous()
        out = torch.empty((x2.shape[0], self.n), dtype=torch.float32)
        lib = quant_kernels.get()
        if lib is not None and x2.shape[0] >= dense_min_rows():
            self._dense_linear(lib, x2, bias, residual, out)
            return out.to(x.dtype).reshape(*lead, self.n)
        for seg in self.segments:
            view = out[:, seg.row0:seg.row0 + seg.rows]
            if seg.format is None:
                view.copy_(F.linear(x2, seg.blocks))
            elif lib is not None and x2.shape[0] > 0:
                status = lib.dp_quant_linear(ctypes.byref(seg.desc), x2.data_ptr(), x2.shape[0], x2.stride(0),
                                             view.data_ptr(), out.stride(0))
                if status != 0:
                    raise ValueError(f"quantized linear: {seg.format.name} [{seg.rows}, {self.k}] not supported")
            else:
                view.copy_(F.linear(x2, seg.dequantize(self.k)))
        if bias is not None:
            out += bias.to(torch.float32)
        if residual is not None:
            out += residual.reshape(-1, self.n).to(torch.float32)
        return out.to(x.dtype).reshape(*lead, self.n)

    def _dense_linear(self, lib, x2: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                      out: torch.Tensor) -> None:
        """out = x2 W^T (+ bias) (+ residual) for a prefill-sized x2: each piece of rows of W is
        dequantized into this thread's scratch and multiplied by torch's GEMM into its columns of
        `out`, the bias or residual (fp32) added by the GEMM itself."""
        addend = None
        if residual is not None:
            addend = residual.reshape(-1, self.n).to(torch.float32)
            if bias is not None:
                addend = addend + bias.to(torch.float32)
        elif bias is not None:
            addend = bias.to(torch.float32).reshape(1, self.n)
        piece_rows = max(1, min(self.n, SCRATCH_MAX_ELEMS // self.k))
        for seg in self.segments:
            for r0 in range(0, seg.rows, piece_rows):
                rows = min(piece_rows, seg.rows - r0)
                c0 = seg.row0 + r0
                if seg.format is None:
                    w = seg.blocks[r0:r0 + rows]
                else:
                    w = _dequantize_scratch(rows * self.k).view(rows, self.k)
                    if lib.dp_quant_dequantize_range(ctypes.byref(seg.desc), r0, rows, w.data_ptr()) != 0:
                        raise ValueError(f"quantized linear: {seg.format.name} [{seg.rows}, {self.k}] not supported")
                target = out[:, c0:c0 + rows]
                if addend is None:
                    torch.mm(x2, w.t(), out=target)
                else:
                    torch.addmm(addend[:, c0:c0 + rows], x2, w.t(), out=target)

    def embedding(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows `token_ids` of W, dequantized, in the compute dtype."""
        ids = token_ids.reshape(-1).to(torch.long).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n):
            raise IndexError(f"token id outside [0, {self.n})")
        out = torch.empty((ids.numel(), self.k), dtype=torch.float32)
        lib = quant_kernels.get()
        for seg in self.segments:
            inside = (ids >= seg.row0) & (ids < seg.row0 + seg.rows)
            if not bool(inside.any()):
                continue
            local = (ids[inside] - seg.row0).contiguous()
            if seg.format is None:
                rows = seg.blocks[local]
            elif lib is not None:
                rows = torch.empty((local.numel(), self.k), dtype=torch.float32)
                lib.dp_quant_dequantize_rows(ctypes.byref(seg.desc), local.data_ptr(), local.numel(), rows.data_ptr())
            else:
                rows = Segment(0, seg.blocks[local], seg.format)._gguf_dequantize(self.k)
            out[inside] = rows
        return out.to(self.compute_dtype).reshape(*token_ids.shape, self.k)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], QuantizedWeight):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return args[1].linear(args[0], bias)
        if func is F.embedding and isinstance(args[1], QuantizedWeight):
            return args[1].embedding(args[0])
        return NotImplemented

    def __repr__(self) -> str:
        return f"QuantizedWeight([{self.n}, {self.k}], {'+'.join(self.formats)}, compute {self.compute_dtype})"


def quantize_q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """Q8_0 blocks (int8 per group of 32 along K, fp16 scale) of a dense [N, K] matrix."""
    from gguf.quants import quantize

    fmt = FORMAT_BY_NAME["Q8_0"]
    n, k = weight.shape
    if k % fmt.block_elems:
        raise ModelLoadError(f"int8 weights need K a multiple of 32; this matrix is [{n}, {k}]")
    blocks = quantize(weight.detach().to(torch.float32).numpy(), fmt.ggml_type)
    return QuantizedWeight.from_blocks(np.asarray(blocks).reshape(n, -1), fmt, k)


# GGML's Q5_0: per 32 weights an fp16 scale d, 4 bytes of high bits (bit j of a little-endian
# uint32 for weight j) and 16 bytes of low nibbles (weight j in the low nibble of byte j, weight
# j + 16 in its high nibble); weight = (5-bit value - 16) * d. That is an int8 in [-16, 15] times
# the same d, i.e. exactly a Q8_0 block: no kernel of its own, and no value changes.
Q5_0_GGML_TYPE = 6
_Q5_0_BLOCK_BYTES = 22


def repack_q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 [N, nb * 22] Q5_0 rows -> uint8 [N, nb * 34] Q8_0 rows with the same values."""
    rows, row_bytes = blocks.shape
    if row_bytes % _Q5_0_BLOCK_BYTES:
        raise ModelLoadError(f"Q5_0 rows of {row_bytes} bytes are not whole 22-byte blocks")
    q5 = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, _Q5_0_BLOCK_BYTES)
    high_bits = q5[:, 2:6].copy().view("<u4")  # [blocks, 1]
    bit_of_weight = (high_bits >> np.arange(32, dtype=np.uint32)) & 1  # [blocks, 32]
    nibbles = np.concatenate([q5[:, 6:] & 0x0F, q5[:, 6:] >> 4], axis=1)  # weights 0..15, 16..31
    values = (nibbles | (bit_of_weight.astype(np.uint8) << 4)).astype(np.int16) - 16
    q8 = np.empty((q5.shape[0], 34), dtype=np.uint8)
    q8[:, :2] = q5[:, :2]
    q8[:, 2:] = values.astype(np.int8).view(np.uint8)
    return q8.reshape(rows, -1)


def cat_rows(parts: list) -> torch.Tensor | QuantizedWeight:
    """torch.cat along rows for dense tensors, QuantizedWeight.cat_rows when any part is quantized."""
    if any(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat_rows(parts)
    return torch.cat(parts)
