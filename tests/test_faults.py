"""FaultConfig: the --fault-* options (and their DUALPACE_FAULT_* variables), and what the faults do."""

from __future__ import annotations

import argparse

import pytest

from dualpace.engine.core import EngineConfig, EngineCore
from dualpace.faults import FaultConfig, InjectedFault, add_fault_arguments, flag_name
from dualpace.generation import OfflineGenerator
from dualpace.sampling import FinishReason, SamplingParams
from dualpace.serve.config import ConfigError, resolve_config


def _parse(argv: list[str], environ: dict[str, str]):
    parser = argparse.ArgumentParser(prog="engine")
    add_fault_arguments(parser)
    return FaultConfig.from_args(resolve_config(parser, argv, environ))


def test_nothing_set_means_no_faults():
    faults = _parse([], {"PATH": "/bin", "DUALPACE_OTHER": "1"})
    assert faults == FaultConfig() == FaultConfig.from_args(argparse.Namespace())
    assert not faults.any
    assert faults.step_delay_s == 0.0


def test_every_variable_is_read_with_its_type_through_the_config_module():
    faults = _parse([], {
        "DUALPACE_FAULT_KV_CORRUPT_LAYER": "0",
        "DUALPACE_FAULT_KV_DROP_LAYER": "2",
        "DUALPACE_FAULT_KV_CUT_AFTER_LAYERS": "3",
        "DUALPACE_FAULT_STEP_DELAY_MS": "25",
        "DUALPACE_FAULT_FORWARD_RAISE_AT_STEP": "7",
        "DUALPACE_FAULT_NAN_LOGITS_REQUEST": "victim-1",
    })
    assert faults == FaultConfig(kv_corrupt_layer=0, kv_drop_layer=2, kv_cut_after_layers=3, step_delay_ms=25,
                                 forward_raise_at_step=7, nan_logits_request="victim-1")
    assert faults.any
    assert faults.step_delay_s == pytest.approx(0.025)
    assert _parse(["--fault-step-delay-ms", "5"], {"DUALPACE_FAULT_STEP_DELAY_MS": "25"}).step_delay_ms == 5


def test_a_request_id_is_kept_as_text():
    faults = _parse([], {"DUALPACE_FAULT_NAN_LOGITS_REQUEST": "123"})
    assert faults.nan_logits_request == "123" and faults.any


@pytest.mark.parametrize("name, text, problem", [
    ("DUALPACE_FAULT_STEP_DELAY_MS", "fast", "expected an integer >= 0, got 'fast'"),
    ("DUALPACE_FAULT_STEP_DELAY_MS", "-5", "expected an integer >= 0, got -5"),
    ("DUALPACE_FAULT_KV_CUT_AFTER_LAYERS", "", "expected an integer >= 0, got ''"),
    ("DUALPACE_FAULT_FORWARD_RAISE_AT_STEP", "0", "expected an integer >= 1, got 0"),
    ("DUALPACE_FAULT_FORWARD_RAISE_AT_STEP", "1.5", "expected an integer >= 1, got '1.5'"),
    ("DUALPACE_FAULT_NAN_LOGITS_REQUEST", "", "expected a request id, got an empty value"),
    ("DUALPACE_FAULT_NAN_LOGITS_REQUEST", "  ", "expected a request id, got an empty value"),
])
def test_a_bad_value_names_the_variable(name, text, problem):
    with pytest.raises(ConfigError) as info:
        _parse([], {name: text})
    assert str(info.value).startswith(f"environment {name}: ") and problem in str(info.value)


def test_flag_names_follow_the_fields_and_so_do_their_variables():
    assert flag_name("forward_raise_at_step") == "--fault-forward-raise-at-step"
    assert flag_name("nan_logits_request") == "--fault-nan-logits-request"


def test_forward_raises_only_at_the_chosen_step():
    FaultConfig().check_forward(1)  # off: never raises
    faults = FaultConfig(forward_raise_at_step=3)
    faults.check_forward(1)
    faults.check_forward(2)
    with pytest.raises(InjectedFault, match="at step 3"):
        faults.check_forward(3)
    faults.check_forward(4)




# ---------------------------------------------------------------------- the runner honours them


def test_forward_raise_counts_steps_from_when_the_faults_are_set(tiny):
    core = EngineCore(tiny, EngineConfig(num_kv_blocks=32, block_size=8))
    core.add_request("warm", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    core.step()  # like the daemon's warm-up: not counted
    core.runner.set_faults(FaultConfig(forward_raise_at_step=2))
    core.step()  # forward step 1: "warm" finishes
    assert not core.has_work
    core.step()  # an empty plan runs no forward pass and is not counted
    core.add_request("a", [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(InjectedFault, match="at step 2"):
        core.step()


def test_nan_logits_end_only_the_target_request(tiny):
    core = EngineCore(tiny, EngineConfig(num_kv_blocks=32, block_size=8))
    core.runner.set_faults(FaultConfig(nan_logits_request="bad"))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outputs: dict[str, list[int]] = {"good": [], "bad": []}
    finished = {}
    core.add_request("good", [9, 8, 7, 6], params)
    core.add_request("bad", [1, 2, 3], params)
    for _ in range(20):
        if not core.has_work:
            break
        _, events = core.step()
        for event in events:
            outputs[event.request_id].extend(event.new_token_ids)
            if event.finish_reason is not None:
                finished[event.request_id] = event.finish_reason
    assert finished == {"bad": FinishReason.ERROR, "good": FinishReason.LENGTH}
    assert outputs["bad"] == []
    assert outputs["good"] == OfflineGenerator(tiny).generate([[9, 8, 7, 6]], [params])[0].output_token_ids
    assert core.scheduler.blocks.num_used_blocks == 0  # freed (a full block of "good" may stay cached)
