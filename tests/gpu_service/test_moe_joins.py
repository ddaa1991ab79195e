"""Cooperative joins with a mixture-of-experts model: the CPU engine's decode rows ride in the GPU
engine's steps, routed to their experts beside the GPU's own rows in one post_attention, and both
engines' tokens equal the offline reference (which equals transformers: tests/model/test_parity.py).
The joined-step tests of test_dense_assist_join.py, run on the tiny MoE presets."""

from __future__ import annotations

import pytest

from dualpace.model.loader import LoadedModel, load_model
from tests.gpu_service.test_dense_assist_join import (  # noqa: F401 (collected here with this module's model)
    pytestmark,
    test_a_taken_join_equals_the_staged_path,
    test_joins_ride_in_a_real_gpu_engine_beside_its_own_requests,
)


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"])
def loaded(request, synth_checkpoint) -> LoadedModel:
    model = load_model(str(synth_checkpoint(request.param)), dtype="fp32")
    assert model.config.moe is not None
    return model
