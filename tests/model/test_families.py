"""Every supported family decodes greedy-identical to transformers in fp32 for 32 tokens, from its
Hugging Face folder and from a GGUF made of it (`dualpace model export --gguf f32`), on every path:
the torch stages (what the GPU engine runs; on CPU torch here), the CPU kernels (CPU local), a
Dense Assist split step (attention on the CPU side's KV) and a migration mid-generation.
Checkpoints: transformers' own classes (tests/model/family_checkpoints.py)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from dualpace.engine.transfer.migration import migrate_out
from dualpace.generation import OfflineGenerator
from dualpace.model import cpu_kernels
from dualpace.model.loader import load_model
from dualpace.sampling import SamplingParams
from dualpace_cli.main import main
from tests.engine.test_migration import started, stop, wait_tokens
from tests.helpers import data_socket_send, reference_tokens
from tests.model.family_checkpoints import FAMILY_CHECKPOINTS, write_family_checkpoint
from tests.model.hf_reference import hf_greedy
from tests.model.test_split_forward import make_seqs, run_split

NUM_NEW_TOKENS = 32
PROMPT_LENGTH = 23  # longer than mistral-swa's window of 12
FAMILIES = sorted(FAMILY_CHECKPOINTS)


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    made = {}

    def folder(family: str):
        if family not in made:
            made[family] = write_family_checkpoint(family, tmp_path_factory.mktemp(family))
        return made[family]

    return folder


@pytest.fixture(scope="module")
def family_gguf(family_folders, tmp_path_factory):
    made = {}

    def gguf_path(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"{family}-gguf") / f"{family}.gguf"
            assert main(["model", "export", "--gguf", "f32", "--model", str(family_folders(family)),
                         "--out", str(out)]) == 0
            made[family] = out
        return made[family]

    return gguf_path


def _hf(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _prompt(family: str, vocab_size: int) -> list[int]:
    rng = random.Random(family)
    return [rng.randrange(5, vocab_size) for _ in range(PROMPT_LENGTH)]


def _greedy(loaded, prompt: list[int]) -> list[int]:
    return reference_tokens(loaded, prompt, SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True), block_size=4)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("kernels_on", [True, False], ids=["cpu-kernels", "torch-stages"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_decodes_like_transformers(family, kernels_on, source, family_folders, family_gguf):
    folder = family_folders(family)
    enabled = cpu_kernels._state.get("enabled", True)
    cpu_kernels.set_enabled(kernels_on)
    try:
        loaded = load_model(str(folder if source == "hf" else family_gguf(family)), dtype="fp32")
        assert loaded.model.kernel_capable
        prompt = _prompt(family, loaded.config.vocab_size)
        ours = _greedy(loaded, prompt)
    finally:
        cpu_kernels.set_enabled(enabled)
    assert ours == hf_greedy(_hf(folder), prompt, NUM_NEW_TOKENS)


def test_llama3_gguf_carries_rope_freqs_and_matches_its_folder(family_folders, family_gguf):
    """llama.cpp's form of llama3 scaling (the rope_freqs tensor) is read, not refused, and gives
    the folder's rotation frequencies."""
    from dualpace.model.gguf_loader import open_gguf
    from dualpace.model.rope import inverse_frequencies

    reader = open_gguf(family_gguf("llama3"))
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}
    from_gguf = load_model(str(family_gguf("llama3")), dtype="fp32").config
    from_hf = load_model(str(family_folders("llama3")), dtype="fp32").config
    assert from_gguf.rope_freq_factors is not None and from_hf.rope_scaling is not None
    assert torch.allclose(inverse_frequencies(from_gguf), inverse_frequencies(from_hf), rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_assisted_split_step_matches_transformers(family, family_folders):
    """Remote rows whose attention runs on the CPU side's KV, beside own decodes and a prefill."""
    loaded = load_model(str(family_folders(family)), dtype="fp32")
    seqs = make_seqs(loaded.config.vocab_size, "split")
    _, outputs, channels = run_split(loaded, seqs)
    assert all(not out.dropped for out in outputs) and all(not c.errors for c in channels.values())
    hf_model = _hf(family_folders(family))
    for s in seqs:
        assert len(s.tokens) >= NUM_NEW_TOKENS
        assert s.tokens == hf_greedy(hf_model, s.prompt, len(s.tokens)), s.name


@pytest.mark.parametrize("family", FAMILIES)
async def test_family_migrated_mid_generation_continues_exactly(family, family_folders):
    loaded = load_model(str(family_folders(family)), dtype="fp32")
    source, target = await started(loaded, "src"), await started(loaded, "dst", block_size=4)
    prompt = _prompt(family, loaded.config.vocab_size)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    channel = await source[0].add_request("m", prompt, params)
    await wait_tokens(channel, 10)
    await migrate_out(source[0], "m", data_socket_send(target[0]))
    assert channel.migrated_to == "dst"
    emitted = len(channel.output_token_ids)
    rest = [t async for update in target[0].channel("m").follow(emitted) for t in update.new_token_ids]
    await stop(source, target)
    assert channel.output_token_ids + rest == hf_greedy(_hf(family_folders(family)), prompt, NUM_NEW_TOKENS)
    assert OfflineGenerator(loaded).generate([prompt], [params])[0].output_token_ids == channel.output_token_ids + rest


def test_the_sliding_window_is_exercised(family_folders):
    """Without its window, mistral-swa decodes otherwise: its parity proves the window is applied."""
    import dataclasses

    from dualpace.model.transformer import Transformer

    loaded = load_model(str(family_folders("mistral-swa")), dtype="fp32")
    prompt = _prompt("mistral-swa", loaded.config.vocab_size)
    unwindowed = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, sliding_window=None))
    unwindowed.model = Transformer(unwindowed.config, loaded.model.weights)
    assert _greedy(unwindowed, prompt) != _greedy(loaded, prompt)


@pytest.mark.parametrize("change, named", [
    ({"model_type": "gemma3"}, "architecture 'gemma3'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
])
def test_unsupported_architectures_and_features_are_refused_in_one_line(change, named, family_folders):
    import json

    from dualpace.errors import ModelLoadError
    from dualpace.model.config import ModelConfig

    hf = {**json.loads((family_folders("qwen3") / "config.json").read_text()), **change}
    with pytest.raises(ModelLoadError) as refused:
        ModelConfig.from_hf_dict(hf)
    message = str(refused.value)
    assert "\n" not in message and named in message and "llama, mistral, qwen2, qwen3, phi3" in message


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama3", "phi4-longrope")])
def test_family_gguf_exports_back_to_a_folder_transformers_decodes_alike(family, family_folders, family_gguf,
                                                                          tmp_path):
    """GGUF -> Hugging Face folder (`dualpace model export`): transformers decodes it as the original
    (Gemma's w / w - 1 norms, Phi-3's fused matrices, Q/K order, windows and scales survive both ways)."""
    assert main(["model", "export", "--model", str(family_gguf(family)), "--out", str(tmp_path / "back")]) == 0
    prompt = _prompt(family, 512)
    assert (hf_greedy(_hf(tmp_path / "back"), prompt, NUM_NEW_TOKENS)
            == hf_greedy(_hf(family_folders(family)), prompt, NUM_NEW_TOKENS))
