"""Synthetic checkpoints: Hugging Face compatibility, determinism, margins, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from dualpace.errors import InvalidArgument
from dualpace.model import synth_tokenizer as stok
from dualpace.model.config import ModelConfig
from dualpace.model.synth import PRESETS, count_parameters, get_preset, tensor_specs, write_synthetic_checkpoint
from dualpace_cli import main as cli

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TINY_PRESETS = [name for name, preset in PRESETS.items() if not preset.is_large]
TEXT = "Hello   world!\n\n  the assistant's 12345 naïve café 日本語 🙂 <|im_start|>user\nhi<|im_end|>"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("synth")
    return {name: write_synthetic_checkpoint(name, root / name) for name in TINY_PRESETS}


def _load_state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    return state


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_preset_loads_and_generates_in_transformers(checkpoints, name):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints[name], dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    input_ids = torch.tensor([[stok.IM_START_ID, 100, 200, 300]])
    output = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert output.shape[1] > input_ids.shape[1]
    assert int(output.max()) < PRESETS[name].config.vocab_size


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_config_json_round_trips_to_the_preset(checkpoints, name):
    hf = json.loads((checkpoints[name] / "config.json").read_text())
    assert ModelConfig.from_hf_dict(hf) == PRESETS[name].config
    assert hf["torch_dtype"] == "float32"
    generation = json.loads((checkpoints[name] / "generation_config.json").read_text())
    assert generation["bos_token_id"] == hf["bos_token_id"] == stok.BOS_ID
    assert generation["eos_token_id"] == hf["eos_token_id"] == list(stok.EOS_IDS)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tensor_names_and_shapes_match_the_specs(checkpoints, name):
    state = _load_state(checkpoints[name])
    specs = tensor_specs(PRESETS[name].config)
    assert {key: tuple(value.shape) for key, value in state.items()} == {spec.name: spec.shape for spec in specs}
    assert ("lm_head.weight" in state) == (not PRESETS[name].config.tie_word_embeddings)
    assert all(value.dtype == torch.float32 and torch.isfinite(value).all() for value in state.values())
    stored_one = 0.0 if PRESETS[name].config.family.gemma else 1.0  # Gemma's checkpoints hold w - 1
    assert abs(float(state["model.norm.weight"].mean()) - stored_one) < 0.1


def test_qwen2_has_nonzero_qkv_biases(checkpoints):
    state = _load_state(checkpoints["tiny-qwen2"])
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert float(state[f"model.layers.0.self_attn.{proj}.bias"].abs().mean()) > 0.05
    assert "model.layers.0.self_attn.o_proj.bias" not in state


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tokenizer_round_trips_and_matches_transformers(checkpoints, name):
    folder = checkpoints[name]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    raw_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = PRESETS[name].config
    assert len(hf_tokenizer) == raw_tokenizer.get_vocab_size() == config.vocab_size
    ids = hf_tokenizer(TEXT)["input_ids"]
    assert ids == raw_tokenizer.encode(TEXT).ids
    assert hf_tokenizer.decode(ids) == TEXT
    assert hf_tokenizer.bos_token_id == config.bos_token_id
    assert hf_tokenizer.eos_token_id == config.eos_token_ids[0]
    assert raw_tokenizer.decode(list(range(config.vocab_size)), skip_special_tokens=False)  # every id decodes


def test_chat_template_is_chatml(checkpoints):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["tiny-llama"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_same_seed_gives_identical_bytes(tmp_path, checkpoints):
    again = write_synthetic_checkpoint("tiny-llama", tmp_path / "again", seed=0)
    other = write_synthetic_checkpoint("tiny-llama", tmp_path / "other", seed=1)
    first = checkpoints["tiny-llama"]
    for file_name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / file_name).read_bytes() == (first / file_name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_tiny_llama_greedy_margins_are_clear(checkpoints):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["tiny-llama"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["tiny-llama"])
    sequence = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
    gaps = []
    with torch.no_grad():
        for _ in range(64):
            logits = model(sequence).logits[0, -1]
            assert torch.isfinite(logits).all()
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            sequence = torch.cat([sequence, logits.argmax().view(1, 1)], dim=1)
    assert sum(gaps) / len(gaps) > 0.75
    assert len(set(sequence[0].tolist())) > 16  # not collapsed into one repeated token


def test_llama3_rope_scaling_changes_frequencies(checkpoints):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["tiny-llama3-rope"], dtype=torch.float32)
    config = PRESETS["tiny-llama3-rope"].config
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
    unscaled = 1.0 / (config.rope_theta**exponents)
    scaled = model.model.rotary_emb.inv_freq.float()
    assert torch.allclose(scaled[0], unscaled[0])  # high frequencies untouched
    assert torch.allclose(scaled[-1], unscaled[-1] / config.rope_scaling.factor)  # low ones divided by factor
    assert not torch.allclose(scaled, unscaled)


def test_sharded_checkpoint_has_index_and_same_tensors(tmp_path, checkpoints):
    folder = write_synthetic_checkpoint("tiny-llama-untied", tmp_path / "sharded", max_shard_bytes=100_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard_names = sorted(set(index["weight_map"].values()))
    assert len(shard_names) > 1 and not (folder / "model.safetensors").exists()
    assert sorted(path.name for path in folder.glob("*.safetensors")) == shard_names
    sharded, single = _load_state(folder), _load_state(checkpoints["tiny-llama-untied"])
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[key], single[key]) for key in single)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_bf16_dtype_is_written_and_declared(tmp_path):
    folder = write_synthetic_checkpoint("tiny-qwen2", tmp_path / "bf16", dtype=torch.bfloat16)
    assert all(value.dtype == torch.bfloat16 for value in _load_state(folder).values())
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_non_empty_out_dir_is_refused_unless_forced(tmp_path):
    folder = write_synthetic_checkpoint("tiny-llama", tmp_path / "ckpt", max_shard_bytes=100_000)
    with pytest.raises(InvalidArgument):
        write_synthetic_checkpoint("tiny-llama", folder)
    write_synthetic_checkpoint("tiny-llama", folder, force=True)
    assert sorted(path.name for path in folder.glob("*.safetensors")) == ["model.safetensors"]
    assert not (folder / "model.safetensors.index.json").exists()


def test_unknown_preset_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="known: tiny-llama"):
        get_preset("gpt-5")


@pytest.mark.parametrize(
    ("name", "expected_num_params", "expected_tensor"),
    [
        ("qwen2.5-0.5b", 0.494e9, ("model.layers.23.self_attn.k_proj.bias", (128,))),
        ("llama-3.2-1b", 1.236e9, ("model.layers.15.self_attn.q_proj.weight", (2048, 2048))),
    ],
)
def test_large_preset_shapes_without_allocating(name, expected_num_params, expected_tensor):
    preset = PRESETS[name]
    assert preset.default_dtype == torch.bfloat16 and preset.config.tie_word_embeddings
    assert abs(count_parameters(preset.config) - expected_num_params) / expected_num_params < 0.02
    specs = {spec.name: spec.shape for spec in tensor_specs(preset.config)}
    assert specs[expected_tensor[0]] == expected_tensor[1]
    assert "lm_head.weight" not in specs
    assert ModelConfig.from_hf_dict(preset.config.to_hf_dict()) == preset.config


@pytest.fixture
def model_cli(monkeypatch):
    """cli.main with only the `model` command registered, so sibling commands cannot break these tests."""
    monkeypatch.setattr(cli, "_COMMAND_MODULES", ("dualpace_cli.model",))
    return cli.main


def test_cli_presets_lists_every_preset(model_cli, capsys):
    assert model_cli(["model", "presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)


def test_cli_synth_writes_and_refuses_to_overwrite(model_cli, tmp_path, capsys):
    out_dir = tmp_path / "cli"
    assert model_cli(["model", "synth", "--preset", "tiny-mistral", "--out", str(out_dir), "--seed", "3"]) == 0
    assert (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file()
    capsys.readouterr()
    assert model_cli(["model", "synth", "--preset", "tiny-mistral", "--out", str(out_dir)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert model_cli(["model", "synth", "--preset", "tiny-mistral", "--out", str(out_dir), "--force"]) == 0


@pytest.mark.parametrize(
    "extra_args",
    [["--preset", "nope"], ["--preset", "tiny-llama", "--dtype", "fp8"], ["--preset", "tiny-llama", "--max-shard-mb", "0"]],
)
def test_cli_synth_errors_return_2_with_one_line(model_cli, tmp_path, capsys, extra_args):
    assert model_cli(["model", "synth", "--out", str(tmp_path / "x"), *extra_args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dualpace model: error:") and err.count("\n") == 1
    assert not (tmp_path / "x").exists()
