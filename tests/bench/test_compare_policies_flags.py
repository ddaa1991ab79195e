"""bench.compare_policies: the flags each policy's gpu_service gets."""

import argparse

from bench.compare_policies import gpu_service_flags


def _args(**extra) -> argparse.Namespace:
    return argparse.Namespace(**{"gpu_kv_blocks": 64, "gated_join_layer_wait_ms": 1000.0, **extra})


def test_gated_gets_the_raised_join_layer_wait_and_the_others_the_server_default():
    gated = gpu_service_flags(_args(), "gated")
    assert gated[gated.index("--assist-join-min-layer-wait-ms") + 1] == "1000"
    for policy in ("dualpace", "gpu-only"):
        assert "--assist-join-min-layer-wait-ms" not in gpu_service_flags(_args(), policy)


def test_every_policy_gets_the_pool_and_the_long_stage_timeout():
    for policy in ("dualpace", "gated", "gpu-only"):
        flags = gpu_service_flags(_args(), policy)
        assert flags[flags.index("--kv-blocks") + 1] == "64"
        assert flags[flags.index("--assist-stage-timeout-s") + 1] == "120"


def test_no_raise_when_unset():
    assert "--assist-join-min-layer-wait-ms" not in gpu_service_flags(_args(gated_join_layer_wait_ms=None), "gated")


def test_the_router_queues_as_long_as_the_client_waits_unless_told():
    from bench.compare_policies import router_queue_flags

    args = argparse.Namespace(timeout_s=150.0, router_queue_timeout_s=None)
    assert router_queue_flags(args) == ["--ttft-target-ms", "150000"]
    assert router_queue_flags(argparse.Namespace(timeout_s=150.0, router_queue_timeout_s=40.0)) == \
        ["--ttft-target-ms", "40000"]
    assert router_queue_flags(argparse.Namespace(timeout_s=150.0, router_queue_timeout_s=0.0)) == []


def test_kept_logs_are_named_by_policy_and_daemon(tmp_path):
    from collections import deque

    from bench.compare_policies import keep_logs
    from toolkit.processes import Daemon

    def daemon(*lines):
        return Daemon(process=None, address="127.0.0.1:1", output=deque(lines))

    keep_logs(tmp_path / "logs", "dualpace", [daemon("g\n"), daemon("c\n"), daemon("r1\n", "r2\n")])
    keep_logs(tmp_path / "logs", "gpu-only", [daemon("g\n"), daemon("r\n")])
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "dualpace_cpu_service.log", "dualpace_gpu_service.log", "dualpace_router.log",
        "gpu-only_gpu_service.log", "gpu-only_router.log"]
    assert (tmp_path / "logs" / "dualpace_router.log").read_text() == "r1\nr2\n"
    assert (tmp_path / "logs" / "gpu-only_router.log").read_text() == "r\n"
