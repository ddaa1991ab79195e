"""The C ABI of cpu_kernels.cpp as ctypes sees it: the weight descriptor and every exported
function's argument and result types (loaded by dualpace.model.cpu_kernels)."""

from __future__ import annotations

import ctypes

_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
_ptr = ctypes.c_void_p
_f32 = ctypes.c_float


class WeightDescC(ctypes.Structure):
    """Mirrors WeightDesc in kernel_weights.h."""

    _fields_ = [("format", _i32), ("reserved", _i32), ("data", _ptr), ("N", _i64), ("K", _i64), ("row_bytes", _i64)]


_desc_p = ctypes.POINTER(WeightDescC)
SIGNATURES = {
    "dp_variant_name": ([], ctypes.c_char_p),
    "dp_variant_supported": ([], ctypes.c_int),
    "dp_weight_format_supported": ([_i32], ctypes.c_int),
    "dp_quant_set_activations": ([_i32], _i32),
    "dp_amx_set_enabled": ([ctypes.c_int], ctypes.c_int),
    "dp_amx_min_rows": ([_i64], _i64),
    "dp_linear_bf16": ([_ptr, _i64, _i64, _desc_p, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_int], ctypes.c_int),
    "dp_linear_f32": ([_ptr, _i64, _i64, _desc_p, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_int], ctypes.c_int),
    "dp_set_decode_one_region": ([ctypes.c_int], ctypes.c_int),
    "dp_decode_layers_bf16": ([_ptr, _ptr, _i64, _ptr], ctypes.c_int),
    "dp_decode_layers_f32": ([_ptr, _ptr, _i64, _ptr], ctypes.c_int),
    "dp_decode_step_bf16": ([_ptr, _ptr, _i64, _ptr, _ptr, _ptr], ctypes.c_int),
    "dp_decode_step_f32": ([_ptr, _ptr, _i64, _ptr, _ptr, _ptr], ctypes.c_int),
    "dp_rms_norm_bf16": ([_ptr, _i64, _i64, _i64, _ptr, _f32, _ptr], None),
    "dp_rms_norm_f32": ([_ptr, _i64, _i64, _i64, _ptr, _f32, _ptr], None),
    "dp_rotary_bf16": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "dp_rotary_f32": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], None),
    "dp_silu_mul_bf16": ([_ptr, _i64, _i64, _ptr], None),
    "dp_silu_mul_f32": ([_ptr, _i64, _i64, _ptr], None),
    "dp_first_max_rows_f32": ([_ptr, _i64, _i64, _i64, _ptr], None),
    "dp_bf16_to_f32": ([_ptr, _i64, _ptr], None),
    "dp_kv_write": ([_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64], ctypes.c_int),
    "dp_decode_attention_bf16": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                                  _ptr, _i64], ctypes.c_int),
    "dp_decode_attention_f32": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                                 _ptr, _i64], ctypes.c_int),
    "dp_moe_experts_bf16": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr], ctypes.c_int),
    "dp_moe_experts_f32": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr], ctypes.c_int),
    "dp_moe_route_bf16": ([_ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr], ctypes.c_int),
    "dp_moe_route_f32": ([_ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr], ctypes.c_int),
}
