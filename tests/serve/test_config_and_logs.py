"""--config FILE.toml, DUALPACE_<FLAG> and structured JSON logs with request ids."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from dualpace.sampling import SamplingParams
from dualpace.serve.config import ConfigError, add_config_argument, effective_config, parse_with_config, resolve_config
from dualpace.serve.logging_setup import request_metadata
from dualpace.wire.engine_messages import new_request_to_pb
from dualpace.wire.v1 import engine_pb2_grpc


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="daemon")
    parser.add_argument("--kv-blocks", type=int, default=256)
    parser.add_argument("--grace-s", type=float, default=30.0)
    parser.add_argument("--name", default="gpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--no-migrate", action="store_true")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--pool-blocks", type=int)
    group.add_argument("--pool-gb", type=float)
    add_config_argument(parser)
    return parser


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "daemon.toml"
    path.write_text(text)
    return str(path)


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    config = write(tmp_path, 'kv-blocks = 512\ngrace_s = 5\nname = "file"\nno-migrate = true\n')
    env = {"DUALPACE_GRACE_S": "7.5", "DUALPACE_NAME": "env"}
    args = resolve_config(make_parser(), ["--config", config, "--name", "flag"], env)
    assert args.name == "flag"  # flag > environment > file
    assert args.grace_s == 7.5  # environment > file
    assert args.kv_blocks == 512  # file > default
    assert args.no_migrate is True
    assert args.dtype == "auto"  # default
    args = resolve_config(make_parser(), [], {"DUALPACE_CONFIG": config, "DUALPACE_NO_MIGRATE": "false"})
    assert (args.kv_blocks, args.name, args.no_migrate) == (512, "file", False)
    assert resolve_config(make_parser(), [], {}).kv_blocks == 256


def test_exclusive_flags_follow_precedence(tmp_path: Path) -> None:
    config = write(tmp_path, "pool-gb = 2.5\n")
    args = resolve_config(make_parser(), ["--config", config, "--pool-blocks", "9"], {})
    assert (args.pool_blocks, args.pool_gb) == (9, None)
    with pytest.raises(ConfigError, match="pool-blocks and pool-gb"):
        resolve_config(make_parser(), ["--config", write(tmp_path, "pool-gb = 1.0\npool_blocks = 3\n")], {})


@pytest.mark.parametrize("text, key", [
    ("kv-blockz = 5\n", "kv-blockz"),
    ("kv-blocks = \"many\"\n", "kv-blocks"),
    ("kv-blocks = 1.5\n", "kv-blocks"),
    ("dtype = \"fp16\"\n", "dtype"),
    ("no-migrate = \"maybe\"\n", "no-migrate"),
    ("config = \"other.toml\"\n", "config"),
])
def test_bad_file_keys_are_one_line_errors(tmp_path: Path, capsys, text: str, key: str) -> None:
    config = write(tmp_path, text)
    with pytest.raises(SystemExit) as caught:
        parse_with_config(make_parser(), ["--config", config], {})
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("daemon: error: ") and repr(key) in err


def test_bad_environment_value_and_unreadable_file(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_with_config(make_parser(), [], {"DUALPACE_KV_BLOCKS": "lots"})
    assert "DUALPACE_KV_BLOCKS" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_config(make_parser(), ["--config", str(tmp_path / "missing.toml")], {})
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve_config(make_parser(), ["--config", write(tmp_path, "kv-blocks = \n")], {})


def test_effective_config_masks_secrets() -> None:
    args = argparse.Namespace(tls_key="/etc/k.pem", auth_token_file="/etc/token", api_password="x",
                              max_batch_tokens=512, tls_cert=None)
    assert effective_config(args) == {"api_password": "***", "auth_token_file": "/etc/token",
                                      "max_batch_tokens": 512, "tls_cert": None, "tls_key": "***"}


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=30)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_gpu_service_logs_json_with_config_and_request_id(synth_checkpoint, tmp_path: Path) -> None:
    folder = str(synth_checkpoint("tiny-llama"))
    cert, key = _self_signed(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cr3t-token-value\n")
    config = write(tmp_path, f'kv-blocks = 48\nblock_size = 8\ntls-cert = "{cert}"\ntls-key = "{key}"\n')
    process = subprocess.Popen(
        [sys.executable, "-m", "gpu_service", "--model", folder, "--dtype", "fp32", "--threads", "1",
         "--config", config, "--auth-token-file", str(token_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DUALPACE_MAX_RUNNING": "7"})
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True)
    reader.start()
    try:
        listening = process.stdout.readline()  # the first stdout line, as launchers read it
        assert listening.startswith("gpu_service listening on "), (listening, stderr)
        address = listening.split()[-1]
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(address, credentials) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            metadata = (("authorization", "Bearer s3cr3t-token-value"), *request_metadata("router-req-42"))
            responses = list(stub.Generate(new_request_to_pb("engine-req", [5, 9, 2], SamplingParams(max_tokens=3)),
                                           metadata=metadata, timeout=60))
        assert responses
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        reader.join(timeout=5)
    log = "".join(stderr)
    lines = [line for line in log.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every log line is one JSON object
    assert all("level" in r and "event" in r for r in records), lines
    [start] = [r for r in records if r["event"] == "effective configuration"]
    assert start["config"]["kv_blocks"] == 48 and start["config"]["block_size"] == 8  # from the file
    assert start["config"]["max_running"] == 7  # from the environment
    assert start["config"]["tls_key"] == "***" and start["config"]["auth_token_file"] == str(token_file)
    assert "s3cr3t-token-value" not in log
    generate = [r for r in records if r["event"] == "generate"]
    assert generate and generate[0]["request_id"] == "router-req-42", records
    assert any(r["logger"] == "dualpace.serve.engine_daemon" for r in records)  # stdlib logging as JSON too
