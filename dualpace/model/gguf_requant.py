"""Write a GGUF's weights again in another format (Q8_0, or dense F32 / F16 / BF16), or a Hugging Face
folder as a GGUF (dualpace.model.gguf_write). A GGUF keeps its metadata,
tokenizer and tensor names; 2-D tensors of another type are dequantized and quantized (Q8_0, with
the `gguf` package) or stored dense, norms and other 1-D tensors copied. Q/K rows stay in the
file's (llama.cpp's) order.

For the Q8_0 comparison with llama.cpp (`dualpace model export --gguf q8_0`), for an F32/F16 input
to llama.cpp's `llama-quantize` (a Q4_K_M file: bench/llamacpp_peer.py --quantize), and for tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dualpace.errors import InvalidArgument
from dualpace.model.gguf_loader import open_gguf
from dualpace.model.registry import resolve_model_path

TARGETS = ("q8_0", "f32", "f16", "bf16")


def requantize_gguf(model: str, out_path: Path, target: str = "q8_0") -> Path:
    import gguf
    from gguf.quants import dequantize, quantize

    if target not in TARGETS:
        raise InvalidArgument("--gguf", f"unknown target {target!r}; use {', '.join(TARGETS)}")
    path = resolve_model_path(model)
    out_path = Path(out_path)
    if out_path.exists():
        raise InvalidArgument("--out", f"{out_path} exists")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        from dualpace.model.gguf_write import write_gguf_from_hf

        return write_gguf_from_hf(path, out_path, target)
    qtype, file_type = {
        "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
        "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
        "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
        "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    }[target]
    dense_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    reader = open_gguf(path)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(out_path), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(file_type)
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape.tolist())]  # rows first
        if len(shape) == 2 and tensor.tensor_type != qtype and (qtype in dense_types or shape[1] % 32 == 0):
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
            if qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(tensor.name, values.astype(np.float16))
            elif qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(tensor.name, values)
            else:
                writer.add_tensor(tensor.name, quantize(values, qtype), raw_dtype=qtype)  # uint8 [rows, row bytes]
        else:
            quantized = tensor.tensor_type not in dense_types
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
