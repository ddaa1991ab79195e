"""The prefix cache's salt names the weights as held: the same checkpoint loaded with another
--weights mode (or compute dtype) hashes its blocks differently, so a host tier never takes
blocks computed with other weights; the same load gives the same salt."""

from __future__ import annotations

from dualpace.engine.core import prefix_cache_salt
from dualpace.kv.prefix_hash import BlockHasher
from dualpace.model.loader import load_model


def test_the_salt_names_the_weights_mode_and_formats(synth_checkpoint):
    folder = str(synth_checkpoint("tiny-llama"))
    fp32 = prefix_cache_salt(load_model(folder, dtype="fp32", weights="fp32"))
    assert fp32 == prefix_cache_salt(load_model(folder, dtype="fp32", weights="fp32"))
    int8 = prefix_cache_salt(load_model(folder, dtype="fp32", weights="int8"))
    native = prefix_cache_salt(load_model(folder, dtype="fp32"))
    assert len({fp32, int8, native}) == 3
    assert int8.endswith("|int8:Q8_0") and fp32.endswith("|fp32:float32")
    tokens = list(range(1, 9))
    assert BlockHasher(8, fp32).chain(tokens) != BlockHasher(8, int8).chain(tokens)
