"""The data path in force (shared memory or the TCP data socket) and the profile figures the
planners then use."""

import glob
import logging

import pytest

from dualpace.policy.migration_planner import (
    MEASURED_KV_TRANSFER_BYTES_PER_S,
    MEASURED_KV_TRANSFER_FIXED_MS,
    MigrationConfig,
    transfer_ms,
)
from dualpace.policy.mode_choice import ExecutionMode
from dualpace.profile.cost_model import CostModel, predicted_mode_latencies
from dualpace.profile.data_paths import TRANSPORT_SETTINGS, assist_path, for_paths, kv_path, on_this_host
from dualpace.profile.files import load_profile, parse_profile, profile_to_dict
from dualpace.profile.schema import KVTransfer, ProfileError
from tests.profiles.tiny import tiny_profile_dict


def two_path_profile_dict() -> dict:
    data = tiny_profile_dict()
    data["kv_transfer_paths"] = {"shm": {"bytes_per_s": 320000.0, "fixed_ms": 0.5},
                                 "tcp": {"bytes_per_s": 32000.0, "fixed_ms": 2.0}}
    data["tables"]["assist_ms_shm"] = {"batch": [1, 11], "ms": [3.0, 4.0]}
    data["tables"]["assist_ms"] = {"batch": [1, 11], "ms": [25.0, 25.0]}  # the plain figures
    return data


@pytest.mark.parametrize("address, local", [
    ("127.0.0.1:50051", True), ("127.1.2.3:9", True), ("localhost:50051", True), ("[::1]:50051", True),
    ("unix:/run/dualpace/gpu.sock", True), ("ipv4:127.0.0.1:5", True),
    ("10.0.0.7:50051", False), ("gpu-node:50051", False), ("[2001:db8::1]:50051", False), ("0.0.0.0:1", False),
])
def test_on_this_host_reads_addresses(address, local):
    assert on_this_host(address) is local


def test_kv_path_rule():
    assert kv_path("auto", same_host=True) == "shm"
    assert kv_path("auto", same_host=False) == "tcp"  # the target's data socket
    assert kv_path("tcp", same_host=True) == "tcp"
    assert kv_path("auto", same_host=True, target_pool_in_host_memory=False) == "tcp"  # into a CUDA pool
    for setting in ("grpc", "shared"):
        with pytest.raises(ProfileError, match="--kv-transport"):
            kv_path(setting, same_host=True)


def test_assist_path_rule():
    from cpu_service.assist_shm import TRANSPORTS

    assert assist_path("auto", same_host=True) == "shm"
    assert assist_path("auto", same_host=False) == "tcp"  # gpu_service's data socket
    assert assist_path("tcp", same_host=True) == "tcp" and assist_path("tcp", same_host=False) == "tcp"
    from gpu_service.assist_limits import TRANSPORTS as SERVER_TRANSPORTS

    assert set(TRANSPORT_SETTINGS) == set(TRANSPORTS) == set(SERVER_TRANSPORTS)  # both daemons' choices
    for setting in ("grpc", "ring"):
        with pytest.raises(ProfileError, match="--assist-transport"):
            assist_path(setting, same_host=True)


def test_both_paths_round_trip_through_the_file():
    profile = parse_profile(two_path_profile_dict())
    assert profile.kv_transfer_paths == {"shm": KVTransfer(320000.0, 0.5), "tcp": KVTransfer(32000.0, 2.0)}
    assert parse_profile(profile_to_dict(profile)) == profile
    assert profile_to_dict(parse_profile(tiny_profile_dict())) == tiny_profile_dict()  # no paths: as before


def test_bad_path_entries_are_named():
    data = two_path_profile_dict()
    data["kv_transfer_paths"]["rdma"] = {"bytes_per_s": 1.0, "fixed_ms": 0.0}
    with pytest.raises(ProfileError, match="kv_transfer_paths: unknown path 'rdma'"):
        parse_profile(data)
    data = two_path_profile_dict()
    data["kv_transfer_paths"]["shm"]["bytes_per_s"] = 0
    with pytest.raises(ProfileError, match="kv_transfer_paths.shm.bytes_per_s"):
        parse_profile(data)


def test_planner_and_cost_model_use_the_path_in_force():
    profile = parse_profile(two_path_profile_dict())
    shm, tcp = for_paths(profile, kv="shm", assist="shm"), for_paths(profile, kv="tcp")
    # 1000 tokens x 32 bytes: shm 0.5 ms + 100 ms, the data socket 2 ms + 1000 ms
    assert CostModel(shm).kv_transfer_ms(1000) == pytest.approx(100.5)
    assert CostModel(tcp).kv_transfer_ms(1000) == pytest.approx(1002.0)
    assert transfer_ms(1000, MigrationConfig(predictor=CostModel(shm))) < transfer_ms(
        1000, MigrationConfig(predictor=CostModel(tcp)))
    assert CostModel(shm).assist_ms(1) == pytest.approx(3.0) and CostModel(tcp).assist_ms(1) == pytest.approx(25.0)


def test_an_older_profile_keeps_its_plain_figures():
    profile = parse_profile(tiny_profile_dict())  # no kv_transfer_paths, no assist_ms_* tables
    assert for_paths(profile, kv="shm", assist="shm") is profile
    for path in sorted(glob.glob("profiles/local/smollm2-*-cpu*.json")):
        stored = load_profile(path)
        assert for_paths(stored, kv="shm", assist="tcp").kv_transfer == stored.kv_transfer, path
    with pytest.raises(ProfileError, match="data path"):
        for_paths(profile, kv="rdma")
    with pytest.raises(ProfileError, match="data path"):  # Dense Assist has no gRPC path to price
        for_paths(profile, assist="grpc")


def test_the_data_socket_is_priced_at_its_figures_else_never_faster_than_the_no_profile_default():
    data = two_path_profile_dict()
    data["kv_transfer_paths"].pop("tcp")  # shm measured only, at fast figures
    data["kv_transfer"] = data["kv_transfer_paths"]["shm"] = {"bytes_per_s": 8e9, "fixed_ms": 0.5}
    shm_only = parse_profile(data)
    default = KVTransfer(MEASURED_KV_TRANSFER_BYTES_PER_S, MEASURED_KV_TRANSFER_FIXED_MS)
    assert for_paths(shm_only, kv="tcp").kv_transfer == default  # not shared memory's figures
    assert for_paths(shm_only, kv="shm").kv_transfer == KVTransfer(8e9, 0.5)
    plain = parse_profile(tiny_profile_dict())  # no per-path figures, slower than the default: its own
    assert plain.kv_transfer.bytes_per_s < MEASURED_KV_TRANSFER_BYTES_PER_S
    assert for_paths(plain, kv="tcp").kv_transfer == plain.kv_transfer
    data["kv_transfer_paths"]["tcp"] = {"bytes_per_s": 96000.0, "fixed_ms": 1.0}
    with_tcp = parse_profile(data)
    assert for_paths(with_tcp, kv="tcp").kv_transfer == KVTransfer(96000.0, 1.0)
    assert parse_profile(profile_to_dict(with_tcp)) == with_tcp


def test_an_older_profiles_grpc_figures_are_skipped_with_one_log_line(caplog):
    current = parse_profile(two_path_profile_dict())
    data = two_path_profile_dict()  # the same, plus an older profile's gRPC data path figures
    data["kv_transfer_paths"]["grpc"] = {"bytes_per_s": 1000.0, "fixed_ms": 50.0}
    data["tables"]["assist_ms_grpc"] = {"batch": [1, 11], "ms": [70.0, 90.0]}
    with caplog.at_level(logging.INFO, logger="dualpace.profile.files"):
        older = parse_profile(data, source="profile old.json")
    assert older == current  # everything else read as before, nothing of the gRPC path kept
    assert [r.getMessage() for r in caplog.records] == [
        "profile old.json: skipping kv_transfer_paths.grpc, tables.assist_ms_grpc: figures of a gRPC data path no "
        "transfer takes (KV and Dense Assist move over shm or tcp; `dualpace profile` measures both)"]
    assert for_paths(older, kv="tcp").kv_transfer == KVTransfer(32000.0, 2.0)  # its tcp figures, not gRPC's
    with pytest.raises(ProfileError, match="data path"):  # never a path in force
        for_paths(older, kv="grpc")
    data["kv_transfer_paths"].pop("tcp")
    data["kv_transfer"] = data["kv_transfer_paths"]["shm"] = {"bytes_per_s": 8e9, "fixed_ms": 0.5}
    without_tcp = parse_profile(data)  # the gRPC figures (slower still) do not price the data socket
    assert for_paths(without_tcp, kv="tcp").kv_transfer == KVTransfer(MEASURED_KV_TRANSFER_BYTES_PER_S,
                                                                      MEASURED_KV_TRANSFER_FIXED_MS)
    data["kv_transfer_paths"]["grpc"] = {"bytes_per_s": "fast"}  # skipped whole, never read
    assert parse_profile(data) == without_tcp
    caplog.clear()
    parse_profile(two_path_profile_dict())
    assert not caplog.records  # a current profile: no line


def test_the_kept_validation_profiles_price_the_data_socket_from_their_own_tcp_figures_or_the_default(caplog):
    paths = sorted(glob.glob("profiles/local/validation/profile_*.json"))
    assert paths
    for path in paths:
        with caplog.at_level(logging.INFO, logger="dualpace.profile.files"):
            profile = load_profile(path)
        default = KVTransfer(MEASURED_KV_TRANSFER_BYTES_PER_S, MEASURED_KV_TRANSFER_FIXED_MS)
        expected = profile.kv_transfer_paths.get("tcp", default)
        assert for_paths(profile, kv="tcp").kv_transfer == expected, path
    assert not caplog.records  # no figures of a retired path left in them


def test_assist_over_the_data_socket_seeds_the_chooser_at_its_figures_else_at_the_plain_ones():
    def seeded_assisted_ms(data: dict, assist_transport: str, same_host: bool) -> float:
        profile = for_paths(parse_profile(data), assist=assist_path(assist_transport, same_host))
        # context 0: no attention, so the Assisted seed is the assist figure itself
        return predicted_mode_latencies(CostModel(profile), 1, 0, assist_available=True)[(ExecutionMode.ASSISTED, 1)]

    data = two_path_profile_dict()
    data["tables"]["assist_ms_tcp"] = {"batch": [1, 11], "ms": [8.0, 9.0]}
    assert seeded_assisted_ms(data, "tcp", same_host=True) == pytest.approx(8.0)
    assert seeded_assisted_ms(data, "auto", same_host=False) == pytest.approx(8.0)
    assert seeded_assisted_ms(data, "auto", same_host=True) == pytest.approx(3.0)
    profile = parse_profile(data)
    assert parse_profile(profile_to_dict(profile)) == profile
    older = two_path_profile_dict()  # no assist_ms_tcp: the plain figure
    assert seeded_assisted_ms(older, "tcp", same_host=True) == pytest.approx(25.0)
