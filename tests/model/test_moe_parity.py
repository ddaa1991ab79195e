"""Mixture-of-experts checkpoints made with transformers' own classes (tests/model/moe_checkpoints.py)
decode greedy-identical to transformers in fp32, from the Hugging Face folder and from GGUF files
made from it (F32, and Q8_0 with the experts kept in their blocks against the same file dequantized
at load)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dualpace.model import cpu_kernels
from dualpace.model.loader import load_model
from dualpace.model.quant import QuantizedWeight
from tests.model.hf_reference import hf_greedy, hf_prompt_logits
from tests.model.moe_checkpoints import FAMILIES, VOCAB, load_reference, write_moe_checkpoint
from tests.model.moe_gguf import write_moe_gguf
from tests.model.test_parity import LOGIT_TOLERANCE, NUM_NEW_TOKENS, our_greedy, prompt_logits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            made[family] = write_moe_checkpoint(family, tmp_path_factory.mktemp(family))
        return made[family]

    return make


def _prompt(family: str) -> list[int]:
    rng = random.Random(family)
    return [rng.randrange(VOCAB) for _ in range(19)]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_matches_transformers(family, checkpoint):
    folder = checkpoint(family)
    loaded = load_model(str(folder), dtype="fp32")
    assert loaded.config.moe is not None
    hf_model = load_reference(family, folder)
    prompt = _prompt(family)
    diff = (prompt_logits(loaded, prompt) - hf_prompt_logits(hf_model, prompt)).abs().max().item()
    assert diff < LOGIT_TOLERANCE, f"{family}: max |logit diff| {diff}"
    assert our_greedy(loaded, prompt, NUM_NEW_TOKENS) == hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_path_matches_transformers(family, checkpoint):
    """The stages as plain torch ops, the path a GPU engine runs (the CPU kernels off)."""
    enabled = cpu_kernels._state.get("enabled", True)
    cpu_kernels.set_enabled(False)
    try:
        loaded = load_model(str(checkpoint(family)), dtype="fp32")
        assert cpu_kernels.get() is None
        prompt = _prompt(family)
        tokens = our_greedy(loaded, prompt, NUM_NEW_TOKENS)
    finally:
        cpu_kernels.set_enabled(enabled)
    assert tokens == hf_greedy(load_reference(family, checkpoint(family)), prompt, NUM_NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_f32_matches_transformers(family, checkpoint, tmp_path):
    folder = checkpoint(family)
    gguf_path = write_moe_gguf(folder, tmp_path / f"{family}.gguf")
    loaded = load_model(str(gguf_path), dtype="fp32")
    from_folder = load_model(str(folder), dtype="fp32")
    assert loaded.config.architecture == family and loaded.config.moe == from_folder.config.moe
    hf_model = load_reference(family, folder)
    prompt = _prompt(family)
    assert our_greedy(loaded, prompt, NUM_NEW_TOKENS) == hf_greedy(hf_model, prompt, NUM_NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_q8_0_experts_stay_in_blocks_and_decode_as_dequantized(family, checkpoint, tmp_path):
    gguf_path = write_moe_gguf(checkpoint(family), tmp_path / f"{family}-q8_0.gguf", q8_0=True)
    native = load_model(str(gguf_path), dtype="fp32", weights="native")
    dense = load_model(str(gguf_path), dtype="fp32", weights="fp32")
    sparse = [layer.moe for layer in native.model.weights.layers if layer.moe is not None]
    if not isinstance(native.model.weights.layers[0].qkv_proj, QuantizedWeight):
        pytest.skip("the quantized-weight kernels are off here: the loader dequantized the file")
    assert sparse and all(isinstance(m, QuantizedWeight) and m.formats == ["Q8_0"]
                          for moe in sparse for m in [*moe.expert_gate_up, *moe.expert_down])
    assert all(isinstance(moe.router, torch.Tensor) for moe in sparse)
    for layer_native, layer_dense in zip(native.model.weights.layers, dense.model.weights.layers):
        if layer_native.moe is not None:
            for q, d in zip(layer_native.moe.expert_down, layer_dense.moe.expert_down):
                assert torch.equal(q.dequantize(), d)
    prompt = _prompt(family)
    assert our_greedy(native, prompt, NUM_NEW_TOKENS) == our_greedy(dense, prompt, NUM_NEW_TOKENS)
