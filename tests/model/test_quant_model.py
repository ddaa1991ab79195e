"""The default model (a Q4_1 GGUF with a Q8_0 embedding) with native block weights, against the
same file dequantized to fp32 at load: same matrices (the Q/K un-permute moved raw block rows),
same greedy tokens on 8 prompts x 32, logits within a stated bound; `--weights` modes."""

from __future__ import annotations

import pytest
import torch

from dualpace.errors import InvalidArgument
from dualpace.generation import OfflineGenerator
from dualpace.model import cpu_kernels, quant_activations, quant_kernels
from dualpace.model.loader import describe_weights, load_model, weights_num_bytes
from dualpace.model.quant import QuantizedWeight, quantize_q8_0
from dualpace.model.registry import DEFAULT_MODEL_NAME
from dualpace.sampling import SamplingParams
from tests.model.test_cpu_kernels import one_region
from tests.model.test_parity import prompt_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "import numpy as np\n\nx =",
           "The best way to learn a new language is", "In 1969, the first humans"]
# Max |logit difference| over the prompt positions of the 8 prompts, native vs dequantized fp32
# (logits reach 36 in magnitude). With the kernels' default int16 activations (rounded to 1.5e-5
# of each 16 elements' max) measured 0.0115 (0.004-0.006 on most prompts); with fp32 activations
# only the order of the fp32 sums differs, measured 1.5e-4. The int8 mode (activations rounded to
# int8 per 16 elements from 5 rows: every prompt here; 4e-3 of a run's max, and this model's
# hidden states have single large elements in some blocks) measured 0.88-1.35 per prompt: its
# contract is the KL divergence (bench/quant_kl.py, docs/perf.md), its kernels' exactness is
# tests/model/test_quant.py's.
LOGIT_TOLERANCE = {"int16": 0.03, "fp32": 2e-3, "int8": 2.5}

pytestmark = pytest.mark.skipif(quant_kernels.get() is None, reason="quantized-weight kernels not built here")


@pytest.fixture(scope="module")
def native_fp32():
    return load_model(DEFAULT_MODEL_NAME, dtype="fp32", weights="native")


def test_native_weights_stay_in_their_blocks(native_fp32, default_model_fp32):
    weights = native_fp32.model.weights
    assert isinstance(weights.layers[0].qkv_proj, QuantizedWeight) and weights.layers[0].qkv_proj.formats == ["Q4_1"]
    assert weights.embed_tokens.formats == ["Q8_0"] and weights.lm_head is weights.embed_tokens
    assert weights_num_bytes(weights) < 0.4 * weights_num_bytes(default_model_fp32.model.weights) / 2
    assert "MB in cpu memory" in describe_weights(weights, torch.device("cpu"), torch.float32)
    for i in (0, 29):  # the un-permuted Q/K rows are the same rows the dequantizing loader makes
        dense = default_model_fp32.model.weights.layers[i]
        assert torch.equal(weights.layers[i].qkv_proj.dequantize(), dense.qkv_proj)
        assert torch.equal(weights.layers[i].down_proj.dequantize(), dense.down_proj)


@pytest.mark.parametrize("activations", ["int16", "fp32", "int8"])
def test_prompt_logits_match_dequantized_fp32(native_fp32, default_model_fp32, activations):
    quant_activations.set_activations(activations)
    try:
        diff = 0.0
        for prompt in PROMPTS:
            ids = native_fp32.tokenizer.encode(prompt, add_special_tokens=True)
            diff = max(diff, (prompt_logits(native_fp32, ids) - prompt_logits(default_model_fp32, ids)).abs().max().item())
    finally:
        quant_activations.set_activations("int16")
    assert diff < LOGIT_TOLERANCE[activations], diff


def greedy_token_ids(loaded, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
    ids = [loaded.tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    seqs = OfflineGenerator(loaded).generate(ids, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(ids))
    return [s.output_token_ids for s in seqs]


def test_greedy_tokens_match_dequantized_fp32(native_fp32, default_model_fp32):
    assert greedy_token_ids(native_fp32, PROMPTS) == greedy_token_ids(default_model_fp32, PROMPTS)


@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_chat_answers_paris(native_fp32, activations):
    """In both modes of --quant-activations: int8 prefills the prompt (37 rows) in int8, whose
    special-token rows (outlier channels) are rounded twice; rounded once they answered other text."""
    tok = native_fp32.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    quant_activations.set_activations(activations)
    try:
        seq = OfflineGenerator(native_fp32).generate([ids], [SamplingParams(max_tokens=24)],
                                                     extra_eos_token_ids=tok.chat_stop_token_ids)[0]
    finally:
        quant_activations.set_activations("int16")
    assert "Paris" in tok.decode(seq.output_token_ids, skip_special_tokens=True)


def test_int8_at_load_on_a_checkpoint(synth_checkpoint):
    folder = str(synth_checkpoint("tiny-llama"))
    dense = load_model(folder, dtype="fp32")
    int8 = load_model(folder, dtype="fp32", weights="int8")
    layer, dense_layer = int8.model.weights.layers[0], dense.model.weights.layers[0]
    assert layer.gate_up_proj.formats == ["Q8_0"] and int8.model.weights.embed_tokens.formats == ["Q8_0"]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):  # Q8_0 of the checkpoint's matrices
        assert torch.equal(getattr(layer, name).dequantize(), quantize_q8_0(getattr(dense_layer, name)).dequantize())
    ids = list(range(3, 40))
    a, b = prompt_logits(int8, ids), prompt_logits(dense, ids)
    assert torch.isfinite(a).all() and (a - b).abs().max() < 0.1 * b.abs().max()  # random weights: loose


def test_weights_modes_are_checked():
    with pytest.raises(InvalidArgument):
        load_model(DEFAULT_MODEL_NAME, weights="q3")
    with pytest.raises(InvalidArgument):
        load_model(DEFAULT_MODEL_NAME, dtype="bf16", weights="fp32")


def test_q8_0_export_runs_natively(tmp_path):
    """`dualpace model export --gguf q8_0`: every matrix Q8_0, metadata kept; native Q8_0 weights
    decode as the same file dequantized to fp32 does."""
    from dualpace_cli.main import main

    out = tmp_path / "smollm2-q8_0.gguf"
    assert main(["model", "export", "--gguf", "q8_0", "--out", str(out)]) == 0
    native = load_model(str(out), dtype="fp32", weights="native")
    dense = load_model(str(out), dtype="fp32", weights="fp32")
    assert native.config == dense.config and native.model.weights.layers[3].qkv_proj.formats == ["Q8_0"]
    ids = [native.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS[:3]]
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(ids)
    assert ([s.output_token_ids for s in OfflineGenerator(native).generate(ids, params)]
            == [s.output_token_ids for s in OfflineGenerator(dense).generate(ids, params)])
    assert main(["model", "export", "--gguf", "q8_0", "--out", str(out)]) == 2  # exists: refused


def test_weights_flag_reaches_generate_and_the_engines(synth_checkpoint, capsys):
    import argparse

    from dualpace_cli.main import main
    from dualpace.serve.engine_daemon import add_engine_arguments

    folder = str(synth_checkpoint("tiny-llama"))
    assert main(["generate", "--model", folder, "--prompt-ids", "1,2,3", "--weights", "int8", "--max-tokens", "3",
                 "--json"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, default_name="cpu", default_kv_blocks=8)
    assert parser.parse_args([]).weights == "native" and parser.parse_args(["--weights", "int8"]).weights == "int8"


def test_fused_decode_takes_32_rows_of_block_weights(native_fp32):
    """With block-quantized matrices the one-call decode step runs up to 32 sequences (dense
    matrices of the compute dtype: 8) and gives the per-stage path's logits, both as one parallel
    region (these short contexts) and as one region per operation."""
    from dualpace.kv.storage import KVStorage
    from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors

    cfg = native_fp32.config
    torch.manual_seed(2)
    kv = KVStorage(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv.k.normal_()
    kv.v.normal_()
    work = [SequenceWork([5 + i], 2 + i % 7, [(3 * i + j) % 64 for j in range(3)]) for i in range(20)]
    fused_path = PagedForward(native_fp32.model, kv)
    fused = fused_path._fused_decode(build_step_tensors(work, kv.block_size, kv.device))
    assert fused is not None and fused.max_rows == 32
    assert fused_path._fused_decode(build_step_tensors(work * 2, kv.block_size, kv.device)) is None  # 40 rows
    stages_path = PagedForward(native_fp32.model, kv)
    stages_path._fused_decode = lambda step: None
    a, b = fused_path.forward(work), stages_path.forward(work)
    assert (a - b).abs().max().item() < 1e-3 and torch.equal(a.argmax(-1), b.argmax(-1))
    with one_region(cpu_kernels.get(), False):
        per_op = PagedForward(native_fp32.model, kv).forward(work)
    assert (a - per_op).abs().max().item() < 1e-4 and torch.equal(a.argmax(-1), per_op.argmax(-1))


def test_one_region_step_with_long_contexts_matches_per_op(native_fp32):
    """At least as many sequences as threads with contexts past decode_attention's own split: the
    one-region step (a sequence per attention task) gives the per-operation path's logits."""
    from dualpace.kv.storage import KVStorage
    from dualpace.model.paged_forward import PagedForward, SequenceWork

    cfg = native_fp32.config
    torch.manual_seed(3)
    kv = KVStorage(cfg.num_layers, 260, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv.k.normal_()
    kv.v.normal_()
    work = [SequenceWork([7 + i], 480 + 9 * i, list(range(130 * i, 130 * i + 123))) for i in range(2)]
    in_one_region = PagedForward(native_fp32.model, kv).forward(work)
    with one_region(cpu_kernels.get(), False):
        per_op = PagedForward(native_fp32.model, kv).forward(work)
    assert (in_one_region - per_op).abs().max().item() < 1e-4
    assert torch.equal(in_one_region.argmax(-1), per_op.argmax(-1))


def test_one_region_step_takes_a_qkv_of_two_formats():
    """A Q4_K_M file's qkv holds two formats (Q4_K q and k rows, Q6_K v rows): here the default
    model's v rows requantized to Q8_0. The fused step takes such a matrix (each run of rows its own
    chunks), and its one-region logits equal the per-operation C path's bit for bit and the
    per-stage path's (Kernels.linear run by run) to rounding."""
    from dualpace.kv.storage import KVStorage
    from dualpace.model.cpu_fused_decode import FusedDecode
    from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors
    from dualpace.model.quant import Segment

    loaded = load_model(DEFAULT_MODEL_NAME, dtype="fp32", weights="native")
    cfg = loaded.config
    num_qk_rows = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    for layer in loaded.model.weights.layers:
        (run,), k = layer.qkv_proj.segments, layer.qkv_proj.k
        head = QuantizedWeight([Segment(0, run.blocks[:num_qk_rows], run.format)], k)
        layer.qkv_proj = QuantizedWeight.cat_rows([head, quantize_q8_0(run.dequantize(k, num_qk_rows))])
    assert len(loaded.model.weights.layers[0].qkv_proj.formats) == 2
    torch.manual_seed(4)
    kv = KVStorage(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    kv.k.normal_()
    kv.v.normal_()
    assert FusedDecode.applies(loaded.model, kv, cpu_kernels.get())
    work = [SequenceWork([5 + i], 2 + i % 7, [(3 * i + j) % 64 for j in range(3)]) for i in range(8)]
    fused_path = PagedForward(loaded.model, kv)
    assert fused_path._fused_decode(build_step_tensors(work, kv.block_size, kv.device)) is not None
    in_one_region = fused_path.forward(work)
    with one_region(cpu_kernels.get(), False):
        per_op = PagedForward(loaded.model, kv).forward(work)
    assert torch.equal(in_one_region, per_op)
    stages_path = PagedForward(loaded.model, kv)
    stages_path._fused_decode = lambda step: None
    per_stage = stages_path.forward(work)
    assert (in_one_region - per_stage).abs().max().item() < 1e-4
    assert torch.equal(in_one_region.argmax(-1), per_stage.argmax(-1))
