"""`dualpace-router serve --gpu-admission`: which GPU admission rule the router's config carries;
and its --resume-wait-s."""

from __future__ import annotations

import argparse

import pytest

from dualpace.errors import InvalidArgument
from dualpace.policy.admission import GpuAdmission
from router.__main__ import add_serve_arguments, router_config


def config_for(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return router_config(parser.parse_args(["--gpu", "127.0.0.1:1", *argv]), kv_bytes_per_token=1024)


@pytest.mark.parametrize(("argv", "expected"), [
    (("--policy", "gpu-only"), GpuAdmission.OPTIMISTIC),
    (("--policy", "dualpace", "--cpu", "127.0.0.1:2"), GpuAdmission.RESERVE),
    (("--policy", "gated", "--cpu", "127.0.0.1:2"), GpuAdmission.RESERVE),
    (("--policy", "gpu-only", "--gpu-admission", "reserve"), GpuAdmission.RESERVE),
    (("--policy", "dualpace", "--gpu-admission", "optimistic"), GpuAdmission.OPTIMISTIC),
])
def test_default_per_policy_and_the_override(argv, expected):
    assert config_for(*argv).admission.resolved_gpu_admission is expected


def test_unknown_rule_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        config_for("--gpu-admission", "greedy")
    assert "--gpu-admission" in capsys.readouterr().err


def test_a_namespace_with_a_bad_value_is_a_clear_error():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--gpu", "127.0.0.1:1"])
    args.gpu_admission = "greedy"  # e.g. from a config file that bypassed argparse's choices
    with pytest.raises(InvalidArgument, match="--gpu-admission"):
        router_config(args, kv_bytes_per_token=1024)


def test_resume_wait_default_and_a_bad_value():
    assert config_for().resume_wait_s == 60.0 and config_for("--resume-wait-s", "0").resume_wait_s == 0.0
    with pytest.raises(InvalidArgument, match="--resume-wait-s"):
        config_for("--resume-wait-s", "-1")
