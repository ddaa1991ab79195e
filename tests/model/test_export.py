"""`dualpace model export`: the default GGUF as a Hugging Face folder runs identically."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.generation import OfflineGenerator
from dualpace.model.loader import load_model
from dualpace.sampling import SamplingParams
from dualpace_cli.main import main
from tests.model.hf_reference import hf_greedy


@pytest.mark.slow
def test_exported_default_model_matches_gguf_and_loads_in_transformers(tmp_path, default_model_fp32):
    out_dir = tmp_path / "smollm2-hf"
    assert main(["model", "export", "--out", str(out_dir)]) == 0
    exported = load_model(str(out_dir), dtype="fp32")
    assert exported.config == default_model_fp32.config
    prompt_ids = default_model_fp32.tokenizer.encode_chat([{"role": "user", "content": "Name a color."}])
    assert exported.tokenizer.encode_chat([{"role": "user", "content": "Name a color."}]) == prompt_ids

    params = [SamplingParams(max_tokens=12, ignore_eos=True)]
    ours = OfflineGenerator(exported).generate([prompt_ids], params)[0].output_token_ids
    assert ours == OfflineGenerator(default_model_fp32).generate([prompt_ids], params)[0].output_token_ids
    hf_model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert hf_greedy(hf_model, prompt_ids, 12) == ours


def test_export_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "x").write_text("keep me")
    assert main(["model", "export", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "x").read_text() == "keep me"


def test_tokenizer_only_folder_tokenizes_and_renders_chat_like_dualpace(tmp_path, default_model_fp32):
    """The folder Dynamo's frontend reads: Hugging Face's tokenizer built from it gives the ids
    DualPace gives, for text and for the chat template."""
    from transformers import AutoTokenizer

    out_dir = tmp_path / "smollm2-tokenizer"
    assert main(["model", "export", "--tokenizer-only", "--out", str(out_dir)]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(out_dir)
    ours = default_model_fp32.tokenizer
    messages = [{"role": "user", "content": "Name a color."}]
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ours.apply_chat_template(messages)
    assert hf.encode(rendered, add_special_tokens=False) == ours.encode_chat(messages)
    assert hf.encode("The capital of France", add_special_tokens=True) == ours.encode("The capital of France")


def test_hf_folder_exports_bf16_matrices(tmp_path, synth_checkpoint):
    """`--gguf bf16` from a Hugging Face folder: the matrices are the folder's rounded to bf16, norms F32."""
    folder = synth_checkpoint("tiny-llama")
    out = tmp_path / "tiny-bf16.gguf"
    assert main(["model", "export", "--model", str(folder), "--gguf", "bf16", "--out", str(out)]) == 0
    hf, gguf = load_model(str(folder), dtype="fp32"), load_model(str(out), dtype="fp32", weights="fp32")
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        theirs = getattr(hf.model.weights.layers[1], name)
        assert torch.equal(getattr(gguf.model.weights.layers[1], name), theirs.to(torch.bfloat16).float()), name
    assert torch.equal(gguf.model.weights.layers[1].input_norm, hf.model.weights.layers[1].input_norm)
