"""A mixture-of-experts GGUF in Q8_0 (`dualpace model export --gguf q8_0` of a checkpoint made with
transformers' own classes) keeps every expert's matrix in its blocks, sliced from the stacked
ffn_{gate,up,down}_exps tensors, routers dense; it decodes greedy-identical to the same file
dequantized at load. (F32 GGUFs against transformers: tests/model/test_families.py.)"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dualpace.model.loader import load_model
from dualpace.model.quant import QuantizedWeight
from dualpace_cli.main import main
from tests.model.family_checkpoints import write_family_checkpoint
from tests.model.test_parity import NUM_NEW_TOKENS, our_greedy


def _routing(config) -> tuple:
    """The spec apart from how its sparse layers are described, and which layers are sparse."""
    spec = dataclasses.replace(config.moe, decoder_sparse_step=1, mlp_only_layers=())
    return spec, [config.moe.is_sparse_layer(i) for i in range(config.num_layers)]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_q8_0_experts_stay_in_blocks_and_decode_as_dequantized(family, tmp_path):
    folder = write_family_checkpoint(family, tmp_path / family)
    gguf_path = tmp_path / f"{family}-q8_0.gguf"
    assert main(["model", "export", "--gguf", "q8_0", "--model", str(folder), "--out", str(gguf_path)]) == 0
    native = load_model(str(gguf_path), dtype="fp32", weights="native")
    if not isinstance(native.model.weights.layers[0].qkv_proj, QuantizedWeight):
        pytest.skip("the quantized-weight kernels are off here: the loader dequantized the file")
    dense = load_model(str(gguf_path), dtype="fp32", weights="fp32")
    from_folder = load_model(str(folder), dtype="fp32").config
    assert native.config.moe == dense.config.moe
    assert _routing(native.config) == _routing(from_folder)  # a GGUF names its dense layers, not the step
    sparse = [(q.moe, d.moe) for q, d in zip(native.model.weights.layers, dense.model.weights.layers)
              if q.moe is not None]
    assert sparse and all(isinstance(m, QuantizedWeight) and m.formats == ["Q8_0"]
                          for moe, _ in sparse for m in [*moe.expert_gate_up, *moe.expert_down])
    assert all(isinstance(moe.router, torch.Tensor) for moe, _ in sparse)  # routers stay F32
    for moe, moe_dense in sparse:
        for q, d in zip(moe.expert_down, moe_dense.expert_down):
            assert torch.equal(q.dequantize(), d)
    rng = random.Random(family)
    prompt = [rng.randrange(5, native.config.vocab_size) for _ in range(19)]
    assert our_greedy(native, prompt, NUM_NEW_TOKENS) == our_greedy(dense, prompt, NUM_NEW_TOKENS)
