"""--peer: which MigrateOut targets an engine accepts, compared after normalisation."""

from __future__ import annotations

import argparse

import pytest

from dualpace.errors import InvalidArgument, PermissionDenied
from dualpace.serve.config import resolve_config
from dualpace.serve.engine_daemon import add_engine_arguments
from dualpace.serve.peers import PeerList


@pytest.mark.parametrize("peer, target", [
    ("127.0.0.1:50062", "127.0.0.1:50062"),
    ("localhost:50062", "127.0.0.1:50062"),
    ("127.0.0.1:50062", "LOCALHOST.:50062"),
    ("[::1]:50062", "[0:0:0:0:0:0:0:1]:50062"),
    ("Engine-B.example:7000", "engine-b.example.:7000"),
    ("unix:///run/dualpace/cpu.sock", "unix:/run/dualpace//cpu.sock"),
    ("127.0.0.1:*", "127.0.0.1:41234"),
    ("localhost:*", "127.0.0.1:41234"),
])
def test_listed_targets_pass(peer, target):
    PeerList([peer]).check(target)


@pytest.mark.parametrize("peer, target", [
    ("127.0.0.1:50062", "127.0.0.1:50061"),
    ("127.0.0.1:50062", "127.0.0.2:50062"),
    ("127.0.0.1:*", "10.0.0.1:50062"),
    ("unix:/run/dualpace/cpu.sock", "unix:/run/dualpace/gpu.sock"),
    ("unix:/run/dualpace/cpu.sock", "127.0.0.1:50062"),
    ("engine-b.example:7000", "10.1.2.3:7000"),  # no DNS: a name matches only that name
])
def test_other_targets_are_refused(peer, target):
    with pytest.raises(PermissionDenied, match="not a --peer"):
        PeerList([peer]).check(target)


def test_no_peer_refuses_every_target_and_says_how_to_allow_one():
    with pytest.raises(PermissionDenied, match="--peer ADDR"):
        PeerList().check("127.0.0.1:50062")


@pytest.mark.parametrize("peer", ["127.0.0.1", "127.0.0.1:0", "unix:relative.sock", "300.1.1.1:5", ""])
def test_a_malformed_peer_names_the_flag(peer):
    with pytest.raises(InvalidArgument, match="--peer"):
        PeerList([peer])


def test_a_malformed_target_names_the_field():
    with pytest.raises(InvalidArgument, match="target_address"):
        PeerList(["127.0.0.1:*"]).check("127.0.0.1:*")


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine")
    add_engine_arguments(parser, default_name="e", default_kv_blocks=8)
    return parser


def test_peers_from_flags_environment_and_config_file(tmp_path):
    assert resolve_config(engine_parser(), ["--peer", "a:1", "--peer", "b:2"], {}).peer == ["a:1", "b:2"]
    assert resolve_config(engine_parser(), [], {}).peer == []
    assert resolve_config(engine_parser(), [], {"DUALPACE_PEER": "a:1, unix:/x.sock"}).peer == ["a:1", "unix:/x.sock"]
    config = tmp_path / "engine.toml"
    config.write_text('peer = ["127.0.0.1:50062", "unix:/run/cpu.sock"]\n')
    assert resolve_config(engine_parser(), ["--config", str(config)], {}).peer == ["127.0.0.1:50062",
                                                                                    "unix:/run/cpu.sock"]
    config.write_text('peer = "127.0.0.1:50062"\n')
    assert resolve_config(engine_parser(), ["--config", str(config)], {}).peer == ["127.0.0.1:50062"]


def test_systemd_units_name_each_other_as_peers():
    """The units' default arguments: each engine's --peer is the other engine's --listen."""
    import re
    import shlex
    from pathlib import Path

    units = Path(__file__).resolve().parents[2] / "deploy" / "systemd"

    def default_args(unit: str) -> list[str]:
        match = re.search(r'^Environment=DUALPACE_\w+_ARGS="([^"]*)"', (units / unit).read_text(), re.M)
        return shlex.split(match.group(1))

    def values(args: list[str], flag: str) -> list[str]:
        return [args[i + 1] for i, arg in enumerate(args) if arg == flag]

    gpu, cpu = default_args("dualpace-gpu.service"), default_args("dualpace-cpu.service")
    PeerList(values(gpu, "--peer")).check(values(cpu, "--listen")[0])
    PeerList(values(cpu, "--peer")).check(values(gpu, "--listen")[0])
