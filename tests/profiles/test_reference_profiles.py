"""The reference and what-if profiles: regenerable from their scripts, and saying what they assume."""

from __future__ import annotations

import json

from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.profile.files import load_profile
from profiles.reference import make_a10g_whatif, make_h100_reference

H100 = "profiles/reference/h100_sapphire_rapids_llama3_8b.json"
A10G = "profiles/reference/a10g_epyc_avx2_llama3_8b_whatif.json"


def test_stored_profiles_are_what_their_scripts_build():
    assert json.loads(open(H100).read()) == json.loads(json.dumps(make_h100_reference.build()))
    assert json.loads(open(A10G).read()) == json.loads(json.dumps(make_a10g_whatif.build()))


def test_both_name_the_engine_features_they_assume_but_the_code_lacks():
    for path, transfer in ((H100, "50 GB/s"), (A10G, "25 GB/s")):
        notes = load_profile(path).notes
        assert "NOT YET BUILT" in notes
        for feature in ("CUDA graphs", "flash-style", f"a {transfer} DMA KV transfer", "round trips"):
            assert feature in notes, (path, feature)


def test_a10g_whatif_is_kv_bound_and_slower_by_the_peak_ratios():
    h100, a10g = CostModel(load_profile(H100)), CostModel(load_profile(A10G))
    assert load_profile(A10G).capacities.gpu_kv_blocks < load_profile(H100).capacities.gpu_kv_blocks / 10
    batch = DecodeBatch(1, 1024)
    ratio = a10g.gpu_iteration_ms(0, batch) / h100.gpu_iteration_ms(0, batch)
    assert abs(ratio - 3.35e12 / 600e9) < 0.05
