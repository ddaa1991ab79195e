"""`--dtype auto`: the rule (dualpace.model.dtype_auto.decide) and where the loader applies it."""

from __future__ import annotations

import torch

from dualpace.model.dtype_auto import decide
from dualpace.model.loader import load_model

AVX2_ZEN3 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
ZEN4 = AVX2_ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile"}


def test_native_bf16_cpus_and_gpus_run_bf16():
    for flags in (ZEN4, SAPPHIRE_RAPIDS):
        choice = decide("cpu", flags, kernels_on=True)
        assert (choice.compute, choice.matrices) == (torch.bfloat16, torch.bfloat16)
    assert decide("cuda", frozenset(), kernels_on=False).compute == torch.bfloat16


def test_cpu_without_native_bf16_computes_in_fp32():
    with_kernels = decide("cpu", AVX2_ZEN3, kernels_on=True)
    assert (with_kernels.compute, with_kernels.matrices) == (torch.float32, torch.bfloat16)
    without = decide("cpu", AVX2_ZEN3, kernels_on=False)
    assert (without.compute, without.matrices) == (torch.float32, torch.float32)
    assert "no native bf16" in without.reason


def test_loader_holds_bf16_matrices_with_fp32_compute(synth_checkpoint):
    loaded = load_model(str(synth_checkpoint("tiny-llama")), dtype="fp32", weights="bf16")
    layer = loaded.model.weights.layers[0]
    assert loaded.model.dtype == torch.float32 and layer.input_norm.dtype == torch.float32
    assert layer.qkv_proj.dtype == torch.bfloat16 and loaded.model.weights.embed_tokens.dtype == torch.bfloat16
    hidden = loaded.model.embed(torch.tensor([1, 2]))
    assert hidden.dtype == torch.float32
