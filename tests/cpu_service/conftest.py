"""What the cpu_service system tests share: the tiny model (fp32), its flags and the reference."""

from __future__ import annotations

import pytest

from dualpace.generation import OfflineGenerator
from dualpace.model.loader import load_model

ENGINE_FLAGS = ("--dtype", "fp32", "--threads", "1", "--block-size", "8")


@pytest.fixture(scope="module")
def loaded(model_folder):
    return load_model(model_folder, dtype="fp32")


def solo(loaded, prompt, params):
    """The offline generator's output: a full recompute, equal to Hugging Face's."""
    return OfflineGenerator(loaded).generate([prompt], [params])[0].output_token_ids
