"""Decode kernels for x86-64 CPUs with AVX-512 BF16, built on first use and called via ctypes.

Why: at batch 1 oneDNN's bf16 GEMV streams weights at ~23 GB/s on the development machines
(Zen 4, 2 cores) where a plain read reaches ~45; and a decode layer issued as ~60 small torch
ops spends ~30% of the step in per-op overhead; and gathering paged KV into a dense copy
before attention costs a third of a batch-32 step. `cpu_kernels.cpp` has a GEMV that streams
bf16 weights with AVX512_BF16 dot products, fused RMSNorm / RoPE / SiLU*up, a KV scatter, and
decode attention that reads the KV blocks in place.

Build: `g++ -O3 -march=native -fopenmp -shared` (about 2 s), cached under
`$XDG_CACHE_HOME/dualpace/kernels/` (default `~/.cache/...`) keyed by the source, the compiler
and the CPU's flags, so a later process only loads the .so. Without g++, or on a CPU without
AVX512_BF16, `get()` returns None and callers keep the torch path. `DUALPACE_CPU_KERNELS=0`
(read on the first `get()`, not at import) or `set_enabled(False)` turns the kernels off.

The .so links libgomp by soname and is loaded after torch, so it shares torch's OpenMP
runtime: one pool, one thread count (`torch.set_num_threads`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# bf16 linear layers with at most this many rows of x use the kernel; more rows are GEMM-bound
# and go to oneDNN (measured crossover on Zen 4, see docs/perf.md).
LINEAR_MAX_ROWS = 8

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_f32 = ctypes.c_float
_SIGNATURES = {
    "dp_has_avx512_bf16": ([], ctypes.c_int),
    "dp_linear_bf16": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_int], None),
    "dp_linear_f32": ([_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_int], None),
    "dp_decode_layers_bf16": ([_ptr, _ptr, _i64, _ptr], ctypes.c_int),
    "dp_decode_layers_f32": ([_ptr, _ptr, _i64, _ptr], ctypes.c_int),
    "dp_rms_norm_bf16": ([_ptr, _i64, _i64, _i64, _ptr, _f32, _ptr], None),
    "dp_rms_norm_f32": ([_ptr, _i64, _i64, _i64, _ptr, _f32, _ptr], None),
    "dp_rotary_bf16": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "dp_rotary_f32": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "dp_silu_mul_bf16": ([_ptr, _i64, _i64, _ptr], None),
    "dp_silu_mul_f32": ([_ptr, _i64, _i64, _ptr], None),
    "dp_kv_write": ([_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64], ctypes.c_int),
    "dp_decode_attention_bf16": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                                  _ptr, _i64], ctypes.c_int),
    "dp_decode_attention_f32": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                                 _ptr, _i64], ctypes.c_int),
}

_state: dict[str, object] = {}


def set_enabled(enabled: bool) -> None:
    """Turn the kernels on or off for models built after this call (benchmarks compare both)."""
    _state["enabled"] = enabled


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dualpace" / "kernels"


def library_path() -> Path:
    """Where the built kernels for this source, compiler and CPU live."""
    try:
        compiler = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        compiler = "none"
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(COMPILE_FLAGS), compiler, _cpu_flags()]).encode())
    return _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build(path: Path) -> float:
    """Compile the kernels to `path`; returns the seconds it took."""
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    try:
        subprocess.run(["g++", *COMPILE_FLAGS, "-o", str(tmp_path), str(SOURCE)], check=True, capture_output=True,
                       text=True)
        os.replace(tmp_path, path)  # atomic: concurrent builders each install a complete file
    finally:
        tmp_path.unlink(missing_ok=True)
    return time.perf_counter() - start


def _load() -> Kernels | None:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    if "avx512_bf16" not in _cpu_flags():
        log.info("CPU kernels off: this CPU has no AVX512_BF16")
        return None
    try:
        path = library_path()
        if not path.exists():
            seconds = build(path)
            log.info("built CPU kernels in %.1f s (cached at %s)", seconds, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("CPU kernels unavailable, using torch ops: %s", detail.strip()[:500])
        return None
    for name, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    if not lib.dp_has_avx512_bf16():
        return None
    return Kernels(lib)


def get() -> Kernels | None:
    """The loaded kernels, or None when they are disabled or cannot be built here."""
    if "enabled" not in _state:
        _state["enabled"] = os.environ.get("DUALPACE_CPU_KERNELS", "1") not in ("0", "false", "off")
    if not _state["enabled"]:
        return None
    if "kernels" not in _state:
        _state["kernels"] = _load()
    return _state["kernels"]  # type: ignore[return-value]


def _supported(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32)


class Kernels:
    """Tensor-level wrappers. Inputs must be on the CPU, bf16 or fp32, rows with unit inner stride."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    # -- linear -----------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] @ weight[N, K]^T (+ bias) (+ residual [M, N]). The GEMV kernel for at most
        LINEAR_MAX_ROWS rows (bf16 or fp32), torch (oneDNN / MKL) for more."""
        out_dtype = out_dtype or x.dtype
        rows = x.shape[0]
        if (weight.dtype != x.dtype or rows > LINEAR_MAX_ROWS or rows == 0
                or (bias is not None and bias.dtype != x.dtype) or (residual is not None and residual.dtype != x.dtype)
                or out_dtype not in (x.dtype, torch.float32)):
            if residual is not None:
                y = torch.addmm(residual, x, weight.t()) if bias is None else residual + F_linear(x, weight, bias)
            else:
                y = F_linear(x, weight, bias)
            return y.to(out_dtype)
        if x.stride(-1) != 1:
            x = x.contiguous()
        n, k = weight.shape
        out = torch.empty((rows, n), dtype=out_dtype)
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        fn = self.lib.dp_linear_bf16 if x.dtype == torch.bfloat16 else self.lib.dp_linear_f32
        fn(
            x.data_ptr(), rows, x.stride(0), k, weight.data_ptr(), n,
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            out.data_ptr(), n, 1 if out_dtype == torch.float32 else 0,
        )
        return out

    # -- elementwise ------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=x.dtype)
        fn = self.lib.dp_rms_norm_bf16 if x.dtype == torch.bfloat16 else self.lib.dp_rms_norm_f32
        fn(x.data_ptr(), rows, hidden, x.stride(0), weight.data_ptr(), eps, out.data_ptr())
        return out

    def rotary_(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first `num_heads` heads of each contiguous row of qkv in place; cos/sin
        float32 [rows, head_dim / 2]."""
        fn = self.lib.dp_rotary_bf16 if qkv.dtype == torch.bfloat16 else self.lib.dp_rotary_f32
        fn(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, head_dim, cos.data_ptr(), sin.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        fn = self.lib.dp_silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else self.lib.dp_silu_mul_f32
        fn(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def kv_write(self, k_layer: torch.Tensor, v_layer: torch.Tensor, slot_ids: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> bool:
        """Scatter k, v [T, kv_heads, head_dim] (rows with contiguous heads) into the layer's slots.
        Returns False (nothing written) when the layout does not fit; the caller then uses torch."""
        row = k_layer.shape[-2] * k_layer.shape[-1]
        if k.shape[0] == 0:
            return True
        if (k.dtype != k_layer.dtype or v.dtype != k_layer.dtype or k.stride(0) != v.stride(0)
                or k[0].numel() != row or not (k[0].is_contiguous() and v[0].is_contiguous())
                or slot_ids.dtype != torch.long or not slot_ids.is_contiguous()):
            return False
        esize = k.element_size()
        num_slots = k_layer.numel() // row
        if self.lib.dp_kv_write(k.data_ptr(), v.data_ptr(), k.shape[0], k.stride(0) * esize, slot_ids.data_ptr(),
                                num_slots, k_layer.data_ptr(), v_layer.data_ptr(), row * esize):
            raise IndexError(f"kv write: a slot id is outside [0, {num_slots})")
        return True

    # -- attention --------------------------------------------------------------------------

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
        """As dualpace.model.attention.decode_attention; None when this shape is not supported."""
        batch, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        if (q.dtype != k_cache.dtype or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or q.stride(2) != 1 or q.stride(1) != head_dim or block_tables.dtype != torch.long
                or context_lens.dtype != torch.long):
            return None
        tables = block_tables.contiguous()
        lens = context_lens.contiguous()
        out = torch.empty((batch, num_heads * head_dim), dtype=q.dtype)
        fn = self.lib.dp_decode_attention_bf16 if q.dtype == torch.bfloat16 else self.lib.dp_decode_attention_f32
        status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                    tables.data_ptr(),
                    tables.shape[1] if tables.dim() == 2 else 0, lens.data_ptr(), batch, k_cache.shape[1],
                    num_kv_heads, num_heads // num_kv_heads, head_dim, scale, out.data_ptr(), out.stride(0))
        if status == -2:
            raise IndexError("decode attention: a context length or block id is out of range")
        return out if status == 0 else None


class _LayerArgs(ctypes.Structure):
    """Mirrors LayerArgs in cpu_kernels.cpp."""

    _fields_ = [("H", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("input_norm", _ptr), ("qkv_w", _ptr),
                ("qkv_b", _ptr), ("o_w", _ptr), ("post_norm", _ptr), ("gate_up_w", _ptr), ("down_w", _ptr),
                ("k_cache", _ptr), ("v_cache", _ptr), ("num_blocks", _i64), ("block_size", _i64)]


class _StepArgs(ctypes.Structure):
    """Mirrors StepArgs in cpu_kernels.cpp."""

    _fields_ = [("M", _i64), ("cos", _ptr), ("sin", _ptr), ("slots", _ptr), ("tables", _ptr), ("ld_tables", _i64),
                ("lens", _ptr), ("scratch", _ptr)]


FUSED_HEAD_DIMS = {torch.bfloat16: (32, 64, 128), torch.float32: (16, 32, 64, 128)}


class FusedDecode:
    """All decoder layers of a decode-only step of at most LINEAR_MAX_ROWS sequences in one call:
    per layer RMSNorm, QKV (+bias), RoPE, KV write, paged attention, O + residual, RMSNorm,
    gate/up, SiLU*up, down + residual, with no Python and no tensor allocation between them.
    Built once per (model, KV storage); the weight and cache pointers are fixed at construction."""

    def __init__(self, kernels: Kernels, model, kv):
        cfg = model.config
        self.kernels = kernels
        self.dtype = model.dtype
        self._keep = (model.weights, kv.k, kv.v)  # the pointers below stay valid while these live
        self.num_layers = cfg.num_layers
        self.layers = (_LayerArgs * cfg.num_layers)()
        for i, layer in enumerate(model.weights.layers):
            self.layers[i] = _LayerArgs(
                cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                cfg.rms_norm_eps, cfg.head_dim**-0.5, layer.input_norm.data_ptr(), layer.qkv_proj.data_ptr(),
                None if layer.qkv_bias is None else layer.qkv_bias.data_ptr(), layer.o_proj.data_ptr(),
                layer.post_attention_norm.data_ptr(), layer.gate_up_proj.data_ptr(), layer.down_proj.data_ptr(),
                kv.k[i].data_ptr(), kv.v[i].data_ptr(), kv.num_blocks, kv.block_size)
        self.scratch_per_row = (cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size)
        self._fn = kernels.lib.dp_decode_layers_bf16 if self.dtype == torch.bfloat16 else kernels.lib.dp_decode_layers_f32

    @staticmethod
    def applies(model, kv) -> bool:
        cfg = model.config
        return (model.device.type == "cpu" and kv.device.type == "cpu" and model.dtype == kv.dtype
                and cfg.head_dim in FUSED_HEAD_DIMS.get(model.dtype, ()) and cfg.num_heads // cfg.num_kv_heads <= 16)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_ids: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """Run every layer over hidden [M, H] (contiguous, updated in place)."""
        rows = hidden.shape[0]
        scratch = torch.empty(rows * self.scratch_per_row, dtype=self.dtype)
        step = _StepArgs(rows, cos.data_ptr(), sin.data_ptr(), slot_ids.data_ptr(), block_tables.data_ptr(),
                         block_tables.shape[1], context_lens.data_ptr(), scratch.data_ptr())
        status = self._fn(hidden.data_ptr(), self.layers, self.num_layers, ctypes.byref(step))
        if status == -2:
            raise IndexError("decode step: a slot id, context length or block id is out of range")
        if status != 0:
            raise ValueError("decode step: shape not supported by the fused kernels")


def F_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def usable_for(t: torch.Tensor) -> Kernels | None:
    """The kernels if they apply to tensors like `t` (CPU, bf16 or fp32)."""
    return get() if _supported(t) else None
