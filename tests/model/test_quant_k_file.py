"""A real Q4_K_M file of the default model, made by llama.cpp's own `llama-quantize` from our F32
export (`dualpace model export --gguf f32`), run with native block weights against the same file
dequantized to fp32 at load. SmolLM2-135M's rows of 576 are not a multiple of Q4_K's 256, so
llama-quantize stores most matrices in its fallback Q5_0 (attn_v: Q8_0 for Q6_K) and only
ffn_down (rows of 1536) in Q4_K / Q6_K: the K-quant kernels run on real file blocks there, the
Q5_0 matrices are held as Q8_0 blocks of the same values (no Q5_0 kernel of their own).

Skipped by name where llama-quantize is not built (`python -m bench.llamacpp_peer --quantize`
builds it from the llama.cpp peer's cached source)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import llamacpp_peer
from dualpace.model import quant_kernels
from dualpace.model.gguf_loader import gguf_tensor_types, open_gguf
from dualpace.model.loader import load_model
from dualpace.model.quant import QuantizedWeight
from dualpace.model.registry import DEFAULT_MODEL_NAME, resolve_model_path
from tests.model.test_parity import prompt_logits
from tests.model.test_quant_model import PROMPTS, greedy_token_ids

# Max |logit difference| over the prompt positions of the 8 prompts, native (default int16
# activations) vs the same file dequantized to fp32: measured 0.0043 (fp32 activations: 1.2e-4).
LOGIT_TOLERANCE = 0.03

pytestmark = [
    pytest.mark.skipif(quant_kernels.get() is None, reason="quantized-weight kernels not built here"),
    pytest.mark.skipif(not llamacpp_peer.binary_path(llamacpp_peer.QUANTIZE_BINARY).exists(),
                       reason="llama-quantize not built (python -m bench.llamacpp_peer --quantize builds it)"),
]


@pytest.fixture(scope="module")
def f32_path(tmp_path_factory):
    """`dualpace model export --gguf f32` of the default model, made once for the module (each
    export takes seconds): the file the first test checks and llama-quantize reads."""
    from dualpace_cli.main import main

    out = tmp_path_factory.mktemp("f32") / "smollm2-135m-f32.gguf"
    assert main(["model", "export", "--gguf", "f32", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def q4_k_m_path(tmp_path_factory, f32_path):
    out = tmp_path_factory.mktemp("q4_k_m") / "smollm2-135m-q4_k_m.gguf"
    log = llamacpp_peer.quantize(f32_path, out, "Q4_K_M")
    assert "falling back to" in log  # the 576-wide rows, as the module docstring says
    return out


def test_f32_export_holds_the_dequantized_tensors(f32_path):
    from gguf.quants import dequantize

    from dualpace_cli.main import main

    source = {t.name: t for t in open_gguf(resolve_model_path(DEFAULT_MODEL_NAME)).tensors}
    written = open_gguf(f32_path)
    assert set(gguf_tensor_types(written)) == {"F32"}
    for tensor in written.tensors:
        if tensor.name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
            original = source[tensor.name]
            expected = np.asarray(dequantize(original.data, original.tensor_type), dtype=np.float32)
            assert np.array_equal(np.asarray(tensor.data).reshape(expected.shape), expected)
    assert main(["model", "export", "--gguf", "f32", "--out", str(f32_path)]) == 2  # exists: refused


@pytest.fixture(scope="module")
def native_and_dense(q4_k_m_path):
    return (load_model(str(q4_k_m_path), dtype="fp32", weights="native"),
            load_model(str(q4_k_m_path), dtype="fp32", weights="fp32"))


def test_k_quant_matrices_stay_in_their_blocks(q4_k_m_path, native_and_dense):
    types = gguf_tensor_types(open_gguf(q4_k_m_path))
    assert types.get("Q4_K", 0) > 0 and types.get("Q6_K", 0) > 0 and types.get("Q5_0", 0) > 0
    native, dense = native_and_dense
    down_formats = set()
    for i, layer in enumerate(native.model.weights.layers):
        assert isinstance(layer.down_proj, QuantizedWeight)
        down_formats.update(layer.down_proj.formats)
        assert torch.equal(layer.down_proj.dequantize(), dense.model.weights.layers[i].down_proj)
    assert down_formats == {"Q4_K", "Q6_K"}


def test_q5_0_matrices_are_held_as_q8_0_blocks_of_the_same_values(native_and_dense):
    native, dense = native_and_dense
    for name in ("o_proj", "gate_up_proj"):  # Q5_0 in every layer of this file
        for i in (0, len(native.model.weights.layers) - 1):
            weight = getattr(native.model.weights.layers[i], name)
            assert isinstance(weight, QuantizedWeight) and weight.formats == ["Q8_0"], (name, i, weight)
            assert torch.equal(weight.dequantize(), getattr(dense.model.weights.layers[i], name))


def test_prompt_logits_and_greedy_tokens_match_dequantized_fp32(native_and_dense):
    native, dense = native_and_dense
    diff = 0.0
    for prompt in PROMPTS:
        ids = native.tokenizer.encode(prompt, add_special_tokens=True)
        diff = max(diff, (prompt_logits(native, ids) - prompt_logits(dense, ids)).abs().max().item())
    assert diff < LOGIT_TOLERANCE, diff
    assert greedy_token_ids(native, PROMPTS) == greedy_token_ids(dense, PROMPTS)
