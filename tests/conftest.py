"""Shared fixtures: synthetic checkpoints (made once per session), the tiny synthetic model and
the default model. A session that runs the tests of every kernel variant builds the variants in the
background from its start (kernel_builds.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from dualpace.model import quant_activations
from dualpace.model.loader import load_model
from dualpace.model.registry import DEFAULT_MODEL_NAME, resolve_model_path
from dualpace.serve.logging_setup import reset_logging
from tests.gguf_cache import once_per_file
from tests.kernel_builds import VARIANT_MODULES, start_background_kernel_builds

# Two cores are shared by everything on these machines; one intra-op thread keeps
# tests predictable when daemons run beside them.
torch.set_num_threads(1)

# The daemons the tests start multiply block-quantized weights in the exact mode (the config module
# reads DUALPACE_QUANT_ACTIVATIONS): the identity tests compare their greedy output with the
# dequantized fp32 model's. In-process kernels start exact too; the default mode (int8) is tested
# where named (tests/test_cli_generate.py's chat demo, tests/model/test_quant*.py).
os.environ.setdefault("DUALPACE_QUANT_ACTIVATIONS", "exact")


def pytest_collection_finish(session):
    if not session.config.option.collectonly and any(item.nodeid.startswith(VARIANT_MODULES)
                                                      for item in session.items):
        start_background_kernel_builds()


@pytest.fixture(scope="session", autouse=True)
def gguf_files_parsed_once():
    """In this process a GGUF file is parsed once (tests/gguf_cache.py): ~30 s of the session were
    the same few files parsed again and again. The daemons the tests start parse their own."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", once_per_file(gguf.GGUFReader))
        yield


@pytest.fixture(autouse=True)
def restore_logging():
    """A command run in-process (`dualpace generate`) sets up the daemons' logging, on capsys's
    stream in a test: undone after each test, so later ones do not log to a closed stream."""
    root, ours = logging.getLogger(), logging.getLogger("dualpace")
    levels = root.level, ours.level
    yield
    if reset_logging():
        root.setLevel(levels[0])
        ours.setLevel(levels[1])


@pytest.fixture(autouse=True)
def restore_quant_activations():
    """A command run in-process (`dualpace generate`) applies --quant-activations to
    the kernels of the whole process: the mode before the test is restored after it."""
    before = quant_activations.activation_mode_id()
    yield
    if quant_activations.activation_mode_id() != before:
        names = {v: k for k, v in quant_activations.ACTIVATION_MODES.items()}
        quant_activations.set_activations(names[before])


@pytest.fixture(scope="session")
def synth_checkpoint(tmp_path_factory):
    """synth_checkpoint(preset) -> folder of a synthetic HF checkpoint, written once per session."""
    from dualpace.model.synth import write_synthetic_checkpoint

    made = {}

    def make(preset: str):
        if preset not in made:
            out_dir = tmp_path_factory.mktemp(preset)
            write_synthetic_checkpoint(preset, out_dir, seed=0)
            made[preset] = out_dir
        return made[preset]

    return make


@pytest.fixture(scope="session")
def tiny_folder(synth_checkpoint) -> str:
    """The tiny synthetic Llama's checkpoint folder."""
    return str(synth_checkpoint("tiny-llama"))


@pytest.fixture(scope="module")
def model_folder(tiny_folder) -> str:
    """The folder a module's daemons serve: the tiny model, unless overridden (tests/router/conftest.py
    serves a copy with a tool-calling chat template)."""
    return tiny_folder


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    """The tiny synthetic Llama (tiny-llama preset) loaded in float32, once per test module."""
    return load_model(tiny_folder, dtype="fp32")


@pytest.fixture(scope="session")
def default_model_fp32():
    """The default model (SmolLM2-135M-Instruct GGUF) loaded in float32."""
    return load_model(DEFAULT_MODEL_NAME, dtype="fp32", weights="fp32")


@pytest.fixture(scope="session")
def default_model_path():
    return resolve_model_path(DEFAULT_MODEL_NAME)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    """The default model's tokenizer, read from its GGUF once per session (seconds: the whole
    vocabulary is parsed)."""
    import gguf

    from dualpace.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf.GGUFReader(default_model_path))
