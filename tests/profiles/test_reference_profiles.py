"""The reference and what-if profiles: regenerable from their scripts, and saying what they assume."""

from __future__ import annotations

import json

import pytest

from dualpace.policy.migration_planner import MEASURED_KV_TRANSFER_BYTES_PER_S, MEASURED_KV_TRANSFER_FIXED_MS
from dualpace.profile.cost_model import CostModel, DecodeBatch
from dualpace.profile.files import load_profile
from profiles.reference import make_a10g_whatif, reference_profiles
from profiles.reference.engine_features import MEASURED, REQUIRED_FEATURES
from profiles.reference.roofline import LAYERS

H100 = "profiles/reference/h100_sapphire_rapids_llama3_8b.json"
A10G_WHATIF = "profiles/reference/a10g_epyc_avx2_llama3_8b_whatif.json"
NAMES = reference_profiles.PROFILE_NAMES


def _cost(name: str) -> CostModel:
    return CostModel(load_profile(reference_profiles.path_of(name)))


def test_stored_profiles_are_what_their_scripts_build():
    for name in NAMES:
        stored = json.loads(reference_profiles.path_of(name).read_text())
        assert stored == json.loads(json.dumps(reference_profiles.build(name))), name
    assert json.loads(open(A10G_WHATIF).read()) == json.loads(json.dumps(make_a10g_whatif.build()))


@pytest.mark.parametrize("name", NAMES)
def test_each_profile_states_its_engine_features_and_the_source_of_every_figure(name):
    profile = load_profile(reference_profiles.path_of(name))
    info = profile.profiler
    assert info["variant"] == ("measured_overheads" if name.endswith("_measured_overheads") else "assumed")
    by_key = {f["feature"]: f for f in info["engine_features"]}
    assert set(REQUIRED_FEATURES) <= set(by_key), name
    for feature in by_key.values():
        assert feature["status"] == "not built" or feature["status"].startswith("built"), feature
        assert feature["assumed"] and feature["code_today"] and feature["measured_variant"], feature
    assert by_key["cuda_graphs"]["status"] == "not built" and by_key["kv_transfer"]["status"] == "not built"
    not_built = [k for k, f in by_key.items() if f["status"] == "not built"]
    missing_part = profile.notes.split("NOT YET BUILT: ")[1].split(".")[0]
    assert missing_part.split(", ") == not_built, profile.notes
    assert info["figures"] and all(f["source"] and f["value"] for f in info["figures"])
    assert (reference_profiles.HERE / info["doc"]).exists()


@pytest.mark.parametrize("box", list(reference_profiles.BOXES))
def test_the_measured_variant_carries_the_codes_overheads_and_nothing_else_changes(box):
    assumed = load_profile(reference_profiles.path_of(box))
    measured = load_profile(reference_profiles.path_of(box + reference_profiles.MEASURED_SUFFIX))
    assert measured.kv_transfer.bytes_per_s == MEASURED_KV_TRANSFER_BYTES_PER_S
    assert measured.kv_transfer.fixed_ms == MEASURED_KV_TRANSFER_FIXED_MS
    assert assumed.kv_transfer.fixed_ms == 1.0 and assumed.kv_transfer.bytes_per_s >= 25e9
    for table in ("cpu_dense_ms", "cpu_attention_ms", "lm_head_sampling_ms"):
        assert measured.tables[table] == assumed.tables[table], table
    assert measured.capacities == assumed.capacities
    # eager launches are a floor under every GPU iteration: one layer's ops x the launch cost
    floor_ms = LAYERS * MEASURED.launch_ms_per_layer + MEASURED.engine_loop_overhead_ms
    assert min(min(row) for row in measured.tables["gpu_decode_ms"].ms) >= floor_ms - 1e-6
    for a, m in zip(assumed.tables["assist_ms"].ms, measured.tables["assist_ms"].ms):
        assert m > a


def test_the_h100_box_is_rarely_kv_bound_and_the_24_gb_boxes_are():
    h100 = load_profile(H100).capacities.gpu_kv_blocks
    for box in ("a10g_epyc_avx2_llama3_8b", "l4_sapphire_rapids_llama3_8b"):
        assert load_profile(reference_profiles.path_of(box)).capacities.gpu_kv_blocks < h100 / 10


@pytest.mark.parametrize("box, bandwidth", [("a10g_epyc_avx2_llama3_8b", 600e9), ("l4_sapphire_rapids_llama3_8b", 300e9)])
def test_memory_bound_gpu_decode_follows_the_datasheet_bandwidth(box, bandwidth):
    ratio = (_cost(box).gpu_iteration_ms(0, DecodeBatch(1, 1024)) - 1.0) / \
        (_cost("h100_sapphire_rapids_llama3_8b").gpu_iteration_ms(0, DecodeBatch(1, 1024)) - 1.0)
    assert abs(ratio - 3.35e12 / bandwidth) < 0.02 * ratio


def test_the_avx2_host_is_compute_bound_where_the_amx_host_is_not():
    a10g, l4 = _cost("a10g_epyc_avx2_llama3_8b"), _cost("l4_sapphire_rapids_llama3_8b")
    assert a10g.profile.tables["cpu_dense_ms"].ms[5] > 2.5 * a10g.profile.tables["cpu_dense_ms"].ms[0]  # batch 32 vs 1
    assert l4.profile.tables["cpu_dense_ms"].ms[5] == l4.profile.tables["cpu_dense_ms"].ms[0]


def test_the_whatif_names_the_engine_features_it_assumes_but_the_code_lacks():
    notes = load_profile(A10G_WHATIF).notes
    assert "NOT YET BUILT" in notes
    for feature in ("CUDA graphs", "flash-style", "a 25 GB/s DMA KV transfer", "round trips"):
        assert feature in notes, feature


def test_a10g_whatif_is_kv_bound_and_slower_by_the_peak_ratios():
    h100, a10g = CostModel(load_profile(H100)), CostModel(load_profile(A10G_WHATIF))
    assert load_profile(A10G_WHATIF).capacities.gpu_kv_blocks < load_profile(H100).capacities.gpu_kv_blocks / 10
    batch = DecodeBatch(1, 1024)
    ratio = a10g.gpu_iteration_ms(0, batch) / h100.gpu_iteration_ms(0, batch)
    assert abs(ratio - 3.35e12 / 600e9) < 0.05


def test_an_unknown_reference_profile_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown reference profile"):
        reference_profiles.build("h100_typo")
