"""`dualpace generate` end to end: the chat demo, JSON output, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dualpace_cli.main import main


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def is_log_line(line: str) -> bool:
    """A start-up log line (one JSON object: stderr is not a terminal here)."""
    try:
        return "event" in json.loads(line)
    except (ValueError, TypeError):
        return False


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip() and not is_log_line(line)]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.slow
def test_chat_demo_answers_paris():
    """What `make serve` runs: the default model, its chat template, default dtype and
    --quant-activations (int8: the prompt's 37 rows in int8 on a CPU with AVX-512 VNNI)."""
    result = subprocess.run(
        [sys.executable, "-m", "dualpace", "generate", "--chat", "--prompt", "What is the capital of France?",
         "--max-tokens", "32", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    # the start-up lines: the kernels' variant (or why there are none), the dtype decision, the weights' memory
    events = [json.loads(line)["event"] for line in result.stderr.splitlines() if is_log_line(line)]
    assert any(e.startswith("CPU kernels: variant ") or "unavailable, using torch ops" in e for e in events), events
    assert any(e.startswith("--dtype auto: ") for e in events), events
    assert any(e.startswith("weights: ") and " MB in cpu memory" in e for e in events), events


def test_json_output_and_batch(capsys, synth_checkpoint):
    folder = str(synth_checkpoint("tiny-llama"))
    code, out, err = run_cli(capsys, "generate", "--model", folder, "--prompt-ids", "5,6,7,8", "--batch", "3",
                             "--max-tokens", "5", "--ignore-eos", "--dtype", "fp32", "--json")
    assert code == 0
    assert any(is_log_line(line) and "MB in cpu memory" in json.loads(line)["event"] for line in err.splitlines())
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 3
    assert all(len(row["token_ids"]) == 5 and isinstance(row["text"], str) for row in rows)
    assert rows[0]["prompt_token_ids"] == [5, 6, 7, 8]
    assert len({tuple(row["prompt_token_ids"]) for row in rows}) == 3


def test_missing_checkpoint(capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert_one_line_error(code, err, "not found")


def test_corrupt_safetensors(capsys, tmp_path, synth_checkpoint):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    source = synth_checkpoint("tiny-llama")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((source / name).read_bytes())
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "weights")


def test_corrupt_gguf(capsys, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x07" * 200)
    code, _, err = run_cli(capsys, "generate", "--model", str(path), "--prompt", "hi")
    assert_one_line_error(code, err, "GGUF")


def test_unsupported_architecture(capsys, tmp_path, synth_checkpoint):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    config = json.loads((synth_checkpoint("tiny-llama") / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "hi")
    assert_one_line_error(code, err, "unsupported architecture", "gpt2")


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--min-p", "2"], "min_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--batch", "0"], "--batch"),
    ],
)
def test_bad_sampling_values(capsys, synth_checkpoint, extra, field):
    folder = str(synth_checkpoint("tiny-llama"))
    code, _, err = run_cli(capsys, "generate", "--model", folder, "--prompt-ids", "1,2", *extra)
    assert_one_line_error(code, err, field)


def test_out_of_vocabulary_token(capsys, synth_checkpoint):
    folder = str(synth_checkpoint("tiny-llama"))
    code, _, err = run_cli(capsys, "generate", "--model", folder, "--prompt-ids", "1,99999")
    assert_one_line_error(code, err, "99999", "vocabulary")


def test_prompt_longer_than_context(capsys, synth_checkpoint):
    folder = synth_checkpoint("tiny-llama3-rope")
    max_context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    ids = ",".join(["7"] * (max_context + 5))
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt-ids", ids)
    assert_one_line_error(code, err, "prompt", "context")


def test_prompt_plus_max_tokens_over_context(capsys, synth_checkpoint):
    folder = synth_checkpoint("tiny-llama3-rope")
    max_context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    ids = ",".join(["7"] * (max_context - 4))
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt-ids", ids, "--max-tokens", "10")
    assert_one_line_error(code, err, "max_tokens", "context")


def test_malformed_prompt_ids(capsys, synth_checkpoint):
    code, _, err = run_cli(capsys, "generate", "--model", str(synth_checkpoint("tiny-llama")), "--prompt-ids", "1,x")
    assert_one_line_error(code, err, "--prompt-ids")


def test_traceback_on_request(synth_checkpoint):
    with pytest.raises(Exception):
        main(["--traceback", "generate", "--model", str(synth_checkpoint("tiny-llama")), "--prompt-ids", "1,99999"])
