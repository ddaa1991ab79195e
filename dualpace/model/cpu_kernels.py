"""Decode kernels for CPUs, one source tree built per instruction set and called via ctypes.

Why: at batch 1 oneDNN's bf16 GEMV streams weights well below the copy bandwidth, a decode
layer issued as ~60 small torch ops spends ~30% of the step in per-op overhead, and gathering
paged KV into a dense copy before attention costs a third of a batch-32 step; on a CPU without
AVX512_BF16, torch's bf16 ops are emulated. `cpu_kernels.cpp` has a streaming GEMV (bf16, fp32
or, through quant_gemv.h, GGUF block weights), fused RMSNorm / RoPE / SiLU*up, a KV scatter,
decode attention that reads the KV blocks in place, and the fused whole-step decode.

Build and dispatch (dualpace/model/KERNELS.md; cpu_kernels_build.py): the best variant this CPU
runs (avx512_bf16, avx512, avx2, else generic = plain C++ with -march=native) is built on first
use (or by `make venv`), cached per source + compiler + variant, and logged once.
`DUALPACE_CPU_KERNELS=0` (read on the first `get()`, not at import) or `set_enabled(False)` turns
the kernels off; `DUALPACE_CPU_KERNELS=<variant>` forces a variant the CPU supports (an AVX-512
machine testing the avx2 code). Without g++, `get()` returns None and callers keep torch ops.

The weight seam: a matrix is a torch tensor (fp32/bf16, in the compute dtype or not) or a
quantized-weight object with `kernel_desc()` (KERNELS.md); `Kernels.linear` takes both.

The .so links libgomp by soname and is loaded after torch, so it shares torch's OpenMP
runtime: one pool, one thread count (`torch.set_num_threads`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch

from dualpace.model import quant_activations
from dualpace.model import cpu_kernels_build as kbuild
from dualpace.model.cpu_kernels_abi import SIGNATURES as _SIGNATURES
from dualpace.model.cpu_kernels_abi import WeightDescC
from dualpace.model.cpu_kernel_ops import ElementwiseAndAttentionOps

log = logging.getLogger(__name__)

# Linear layers with at most this many rows of x use the kernel when the weight is a dense
# tensor of x's dtype; more rows are GEMM-bound and go to oneDNN (the crossover measured).
LINEAR_MAX_ROWS = 8
# A dense weight of another dtype than x (bf16 matrices, fp32 compute): the kernel up to this many
# rows; beyond, the matrix is widened to fp32 once per call for oneDNN (crossover between 32 and 64
# rows on an AVX2 Zen 3: 224 against 360 ms at 32 rows, 269 against 208 at 64).
MIXED_MAX_ROWS = 32
# bf16 x and bf16 matrices where the kernels run AMX tiles (amx_bf16 CPU, tile data permitted):
# the kernel up to this many rows (its AMX tiles from dp_amx_min_rows() rows), oneDNN beyond.
# Per call on the Intel Xeon with AMX, ours against oneDNN (itself on AMX at every M there):
# 0.4-0.6x its time at 8-32 rows, even at 64, 1.3x at 128, 2.6x at 512.
AMX_MAX_ROWS = 32
# bf16 x and bf16 matrices without AMX tiles in the avx512_bf16 variant (its vdpbf16ps GEMV): the
# kernel up to this many rows, oneDNN beyond. One A/B on an AMD EPYC Zen 4 (the 1B shape, 2
# threads, quiet), ours against oneDNN from 9 rows: 73.7 against 33.4 tok/s at batch 16, 49.8
# against 37.6 at batch 32.
BF16_DOT_MAX_ROWS = 32
FORMAT_F32, FORMAT_BF16 = 0, 30  # kernel_weights.h (GGML type ids)


_state: dict[str, object] = {}
_loaded: dict[str, "Kernels | None"] = {}


def set_enabled(enabled: bool) -> None:
    """Turn the kernels on or off for models built after this call (benchmarks compare both)."""
    _state["enabled"] = enabled


def _requested() -> str:
    return os.environ.get("DUALPACE_CPU_KERNELS", "1").strip().lower()


def chosen_variant() -> str | None:
    """The variant `get()` uses: the env override when it names a supported variant, else the best."""
    requested = _requested()
    if requested in ("0", "false", "off"):
        return None
    supported = kbuild.supported_variants()
    if requested in kbuild.VARIANTS:
        if requested not in supported:
            log.warning("DUALPACE_CPU_KERNELS=%s: this CPU lacks its features (has: %s); using %s", requested,
                        ", ".join(supported), supported[0])
            return supported[0]
        return requested
    return supported[0]


def load_variant(name: str) -> Kernels | None:
    """The kernels of one variant (built if needed), or None when it cannot be built or run here."""
    if name in _loaded:
        return _loaded[name]
    kernels = None
    variant = kbuild.VARIANTS[name]
    try:
        path, seconds = kbuild.ensure_built(variant)
        if seconds is not None:
            log.info("built CPU kernels (%s) in %.1f s (cached at %s)", name, seconds, path)
        lib = ctypes.CDLL(str(path))
        for fn_name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, fn_name)
            fn.argtypes = argtypes
            fn.restype = restype
        if lib.dp_variant_supported():
            kernels = Kernels(lib, name)
            quant_activations.register(lib)
            _log_amx(kernels)
        else:
            log.warning("CPU kernels (%s) do not run on this CPU", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("CPU kernels (%s) unavailable, using torch ops: %s", name, detail.strip()[:500])
    _loaded[name] = kernels
    return kernels


def _amx_requested() -> bool:
    return os.environ.get("DUALPACE_CPU_AMX", "1").strip().lower() not in ("0", "false", "off")


def _log_amx(kernels: Kernels) -> None:
    """Logs once per variant loaded whether bf16 products of several rows run on AMX tiles."""
    if kernels.amx:
        log.info("CPU kernels (%s): AMX-BF16 tiles for bf16 products of %d-%d rows", kernels.variant,
                 kernels.lib.dp_amx_min_rows(0), AMX_MAX_ROWS)
    elif "amx_bf16" in kbuild.cpu_flags() and kernels.variant == "avx512_bf16":
        why = ("DUALPACE_CPU_AMX=0" if not _amx_requested()
               else "the kernel did not grant the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        log.warning("CPU kernels: the CPU has amx_bf16 but AMX tiles are off (%s); the GEMV up to %d rows",
                    why, LINEAR_MAX_ROWS)


def loaded_kernels() -> list[Kernels]:
    """Every variant loaded in this process so far."""
    return [k for k in _loaded.values() if k is not None]


def get() -> Kernels | None:
    """The loaded kernels, or None when they are disabled or cannot be built here."""
    if "enabled" not in _state:
        _state["enabled"] = _requested() not in ("0", "false", "off")
    if not _state["enabled"]:
        return None
    if "kernels" not in _state:
        name = chosen_variant()
        kernels = load_variant(name) if name else None
        _state["kernels"] = kernels
        if kernels is not None:
            how = ("the compiler's own vectorisation (-march=native)" if name == "generic" else "explicit ISA flags")
            log.info("CPU kernels: variant %s (%s)", name, how)
    return _state["kernels"]  # type: ignore[return-value]


def select_variant(name: str | None) -> Kernels | None:
    """Make `get()` return the kernels of variant `name` (None: off) from now on, e.g. for tests
    that run every variant the CPU supports; returns them (None when they cannot run here)."""
    kernels = load_variant(name) if name else None
    _state["enabled"] = kernels is not None
    _state["kernels"] = kernels
    return kernels


def kernel_info() -> dict:
    """{"variant": the variant in use or "off", "cpu_flags": the CPU's flags that the variants and their
    AMX tiles use, "amx": whether bf16 products of several rows run on AMX tiles}."""
    kernels = get()
    relevant = {flag for v in kbuild.X86_VARIANTS for flag in v.needs} | {"amx_tile", "amx_bf16"}
    return {"variant": kernels.variant if kernels is not None else "off",
            "cpu_flags": sorted(kbuild.cpu_flags() & relevant), "amx": kernels is not None and kernels.amx}


def library_path() -> Path:
    """Where the built kernels of the variant `get()` uses live (for bench/ build timings)."""
    return kbuild.library_path(kbuild.VARIANTS[chosen_variant() or kbuild.default_variant()])


def build(path: Path) -> float:
    """Compile that variant to `path`; returns the seconds it took."""
    return kbuild.build(kbuild.VARIANTS[chosen_variant() or kbuild.default_variant()], path)


def _supported(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32)


def weight_desc(weight) -> WeightDescC | None:
    """The kernels' view of a matrix: a dense fp32/bf16 CPU tensor with unit inner stride, or a
    quantized-weight object's kernel_desc(); None for anything else."""
    if isinstance(weight, torch.Tensor):
        if weight.dim() != 2 or not _supported(weight) or weight.stride(1) != 1:
            return None
        fmt = FORMAT_BF16 if weight.dtype == torch.bfloat16 else FORMAT_F32
        n, k = weight.shape
        return WeightDescC(fmt, 0, weight.data_ptr(), n, k, weight.stride(0) * weight.element_size())
    describe = getattr(weight, "kernel_desc", None)
    if describe is None:
        return None
    described = describe()  # None when the object has no single kernel layout
    if described is None:
        return None
    fmt, ptr, n, k, row_bytes = described
    return WeightDescC(fmt, 0, ptr, n, k, row_bytes)


def run_descs(weight) -> list[tuple[int, WeightDescC]] | None:
    """(first row, descriptor) of each run of rows of a quantized weight whose rows mix block formats
    (a Q4_K_M file's qkv: Q4_K q and k rows, Q6_K v rows); None for one layout, or a run without a
    block format (an F32 run)."""
    runs = getattr(weight, "segments", None)
    if not runs or len(runs) < 2 or any(run.format is None for run in runs):
        return None
    return [(run.row0, WeightDescC(fmt, 0, ptr, n, k, row_bytes))
            for run, (fmt, ptr, n, k, row_bytes) in ((run, run.kernel_desc(weight.k)) for run in runs)]


def torch_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) with torch ops, for a tensor of any dtype or a quantized-weight
    object (which dequantizes on the fly through its own F.linear)."""
    if isinstance(weight, torch.Tensor) and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


class Kernels(ElementwiseAndAttentionOps):
    """Tensor-level wrappers. Inputs must be on the CPU, bf16 or fp32, rows with unit inner stride."""

    def __init__(self, lib: ctypes.CDLL, variant: str):
        self.lib = lib
        self.variant = variant
        self._formats: dict[int, bool] = {}
        # AMX tiles for bf16 x bf16 products (only the avx512_bf16 variant has them, where the CPU
        # and the kernel allow); DUALPACE_CPU_AMX=0 turns them off (read here, on the first load).
        self.amx = bool(lib.dp_amx_set_enabled(1 if _amx_requested() else 0))

    def dense_max_rows(self, dtype: torch.dtype) -> int:
        """Most rows of x that run in the kernels against a dense matrix of x's own dtype."""
        if dtype == torch.bfloat16 and self.amx:
            return AMX_MAX_ROWS
        if dtype == torch.bfloat16 and self.variant == "avx512_bf16":
            return BF16_DOT_MAX_ROWS
        return LINEAR_MAX_ROWS

    def set_amx(self, enabled: bool) -> bool:
        """AMX tiles on or off for this library (benchmarks and tests compare both); returns
        whether they run now. FusedDecode objects built before keep their max_rows."""
        self.amx = bool(self.lib.dp_amx_set_enabled(1 if enabled else 0))
        return self.amx

    def set_one_region(self, enabled: bool) -> bool:
        """A decode step that allows it as one parallel region (the default), or one region per
        operation (tests prove both give the same results); returns the setting before the call."""
        return bool(self.lib.dp_set_decode_one_region(1 if enabled else 0))

    def supports_format(self, fmt: int) -> bool:
        if fmt not in self._formats:
            self._formats[fmt] = bool(self.lib.dp_weight_format_supported(fmt))
        return self._formats[fmt]

    def linear_desc(self, x: torch.Tensor, weight) -> WeightDescC | None:
        """The weight's descriptor when linear(x, weight) would run in the kernels, else None."""
        return self._kernel_desc(x, weight) if _supported(x) else None

    def _kernel_desc(self, x: torch.Tensor, weight, max_rows: int | None = None) -> WeightDescC | None:
        """The weight's descriptor when this product should run in the kernels, else None.
        max_rows: run the kernel up to this many rows whatever is faster (the invariant rows)."""
        rows = x.shape[0]
        if rows == 0:
            return None
        if max_rows is not None:
            if rows > max_rows:
                return None
        elif isinstance(weight, torch.Tensor):
            limit = self.dense_max_rows(x.dtype) if weight.dtype == x.dtype else MIXED_MAX_ROWS
            if rows > limit:
                return None
        elif rows >= getattr(weight, "dense_min_rows", rows + 1):
            return None  # the object's own linear is faster from there (prefill: dequantize + GEMM)
        desc = weight_desc(weight)
        return desc if desc is not None and self.supports_format(desc.format) else None

    # -- linear -----------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               kernel_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight[N, K]^T (+ bias) (+ residual [M, N]). The kernels for at most
        dense_max_rows(x.dtype) rows of a same-dtype tensor weight (LINEAR_MAX_ROWS, AMX_MAX_ROWS
        for bf16 on AMX tiles; MIXED_MAX_ROWS for another dtype, any number for a quantized weight
        whose format the kernels have), torch (oneDNN) otherwise.

        kernel_rows: indices of rows (a step's decode rows) whose outputs must be the kernel's even
        where the product as a whole goes to torch, so that such a row gets bitwise what it gets
        alone or beside other decode rows (batch invariance, tests/model/test_batch_invariance.py;
        in fp32 the kernel's tiles sum every output in one order). Up to MIXED_MAX_ROWS of them;
        more, or a weight the kernels lack, and the rows keep torch's outputs. It costs one more
        weight read in a step that mixes prefill and decode rows."""
        out_dtype = out_dtype or x.dtype
        eligible = (_supported(x) and (bias is None or bias.dtype == x.dtype)
                    and (residual is None or residual.dtype == x.dtype) and out_dtype in (x.dtype, torch.float32))
        desc = self._kernel_desc(x, weight) if eligible else None
        if desc is not None:
            return self._run_kernel(x, desc, bias, residual, out_dtype)
        segments = self._segment_descs(x, weight) if eligible else None
        if segments is not None:
            return self._run_segments(x, segments, bias, residual, out_dtype)
        y = self._torch_linear(x, weight, bias, residual, out_dtype)
        if eligible and kernel_rows is not None and kernel_rows.numel() > 0:
            sub = x.index_select(0, kernel_rows)
            sub_desc = self._kernel_desc(sub, weight, max_rows=MIXED_MAX_ROWS)
            if sub_desc is not None:
                sub_residual = None if residual is None else residual.index_select(0, kernel_rows)
                y.index_copy_(0, kernel_rows, self._run_kernel(sub, sub_desc, bias, sub_residual, out_dtype))
        return y

    def _torch_linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, residual: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
            weight = self.widen(weight)
        if residual is not None and bias is None and isinstance(weight, torch.Tensor) and weight.dtype == x.dtype:
            y = torch.addmm(residual, x, weight.t())  # the residual add fused into the GEMM
        elif residual is not None and hasattr(weight, "kernel_desc"):
            y = weight.linear(x, bias, residual=residual)  # a quantized weight fuses it too
        else:
            y = torch_linear(x, weight, bias)
            if residual is not None:
                y = y + residual
        return y.to(out_dtype)

    def _segment_descs(self, x: torch.Tensor, weight) -> list[tuple[int, WeightDescC]] | None:
        """run_descs(weight) when the kernels have every run's format and would take these rows;
        else None. (Through the torch fallback, each run went to the standalone library, whose
        OpenMP threads wait beside these kernels' on the same cores: a Q4_K_M qkv of the 1B shape
        took 21 ms at one row.)"""
        if x.shape[0] >= getattr(weight, "dense_min_rows", x.shape[0] + 1):
            return None
        runs = run_descs(weight)
        if runs is None or not all(self.supports_format(desc.format) for _, desc in runs):
            return None
        return runs

    def _run_segments(self, x: torch.Tensor, segments: list[tuple[int, WeightDescC]], bias: torch.Tensor | None,
                      residual: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """Each run of rows in the kernels, into its columns of one output."""
        n = sum(desc.N for _, desc in segments)
        out = torch.empty((x.shape[0], n), dtype=out_dtype)
        for row0, desc in segments:
            self._run_kernel(x, desc, None if bias is None else bias[row0:row0 + desc.N],
                             None if residual is None else residual[:, row0:row0 + desc.N], out_dtype,
                             out=out[:, row0:row0 + desc.N])
        return out

    def _run_kernel(self, x: torch.Tensor, desc: WeightDescC, bias: torch.Tensor | None,
                    residual: torch.Tensor | None, out_dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias) (+ residual) in the kernels, into `out` (rows with unit inner stride) or a new tensor."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        if bias is not None:
            bias = bias.contiguous()
        rows, n = x.shape[0], desc.N
        if out is None:
            out = torch.empty((rows, n), dtype=out_dtype)
        fn = self.lib.dp_linear_bf16 if x.dtype == torch.bfloat16 else self.lib.dp_linear_f32
        status = fn(x.data_ptr(), rows, x.stride(0), ctypes.byref(desc), None if bias is None else bias.data_ptr(),
                    None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
                    out.data_ptr(), out.stride(0), 1 if out_dtype == torch.float32 else 0)
        if status != 0:
            raise ValueError(f"linear: weight format {desc.format} has no kernel in variant {self.variant}")
        return out

    def widen(self, t: torch.Tensor) -> torch.Tensor:
        """A bf16 tensor as a new contiguous fp32 one (multi-threaded; torch's copy is not, here)."""
        t = t.contiguous()
        out = torch.empty(t.shape, dtype=torch.float32)
        self.lib.dp_bf16_to_f32(t.data_ptr(), t.numel(), out.data_ptr())
        return out


def usable_for(t: torch.Tensor) -> Kernels | None:
    """The kernels if they apply to tensors like `t` (CPU, bf16 or fp32)."""
    return get() if _supported(t) else None
