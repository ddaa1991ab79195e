"""--cuda-graphs on dualpace-gpu: decode steps replay as CUDA graphs only on CUDA with the paged kernel."""

from __future__ import annotations

import pytest

from dualpace.model import attention_backend
from gpu_service.__main__ import decode_graph_batch, parse_args


def test_graphs_need_cuda_the_flag_and_the_paged_kernel(monkeypatch):
    args = parse_args(["--max-running", "48"])
    assert args.cuda_graphs == "on"
    assert decode_graph_batch(args, "cpu") == 0
    monkeypatch.setattr(attention_backend, "_triton_available", lambda: True)
    assert args.attention_backend == "auto"
    assert decode_graph_batch(args, "cuda") == 48  # one bucket set up to --max-running
    assert decode_graph_batch(parse_args(["--cuda-graphs", "off"]), "cuda") == 0
    gather = parse_args(["--max-running", "48", "--attention-backend", "gather"])  # graphs would gather whole tables
    assert decode_graph_batch(gather, "cuda") == 0
    monkeypatch.setenv("DUALPACE_ATTENTION_BACKEND", "gather")  # the flag's variable, through the config module
    assert decode_graph_batch(parse_args(["--max-running", "48"]), "cuda") == 0


def test_a_bad_value_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graphs", "maybe"])
    assert "--cuda-graphs" in capsys.readouterr().err
