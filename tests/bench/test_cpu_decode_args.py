"""bench.cpu_decode refuses a negative prefill prompt before loading anything."""

import pytest

from bench import cpu_decode, cpu_decode_peer


def test_a_negative_prefill_prompt_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        cpu_decode.main(["--model", "does-not-matter", "--prefill-tokens", "-1"])
    assert exited.value.code == 2
    assert "--prefill-tokens: must be 0" in capsys.readouterr().err


def test_the_peer_table_without_a_prefill_comparison(capsys):
    row = {"batch": 1, "context_tokens": 1024, "ours_tokens_per_s": 16.1, "llamacpp_tokens_per_s": 17.6,
           "ours_over_llamacpp": 0.91, "copy_bandwidth_gb_per_s": 58.0}
    cpu_decode_peer.print_peer_table([row], None)
    out = capsys.readouterr().out
    assert "| 1 | 1024 | 16.1 | 17.6 | 0.91 | 58.0 |" in out and "prefill" not in out
