"""Fault injection for tests of failure handling (never enabled by default).

The engine daemons take one option per fault (`add_fault_arguments`), so each is set like any
other daemon setting (dualpace.serve.config): a flag, its DUALPACE_<FLAG> environment variable
(DUALPACE_FAULT_STEP_DELAY_MS=N), or a --config key. The daemon builds a FaultConfig from its
arguments at start (`FaultConfig.from_args`) and passes it to the parts that honour it.

    --fault-kv-corrupt-layer N          outgoing KV: layer N (N >= 0) arrives damaged. Over the
                                        data socket one byte of it is changed after its checksum
                                        was taken; over shared memory its first token is left half
                                        written and `written` reports only the layers before it
    --fault-kv-drop-layer N             outgoing KV: layer N is never sent. Over the data socket
                                        the stream ends short; over shared memory its first token
                                        is left unwritten and its checksum out of `written`
    --fault-kv-cut-after-layers N       outgoing KV: the sender gives up. Over the data socket
                                        before sending layer N; over shared memory after the copy,
                                        before saying written (N is not used there)
    --fault-kv-shm-hold-ms N            on the shared-memory path, hold the write lease N ms
                                        after the copy, before saying written (kill tests)
    --fault-step-delay-ms N             sleep N ms inside every engine step (a stalled step loop)
    --fault-forward-raise-at-step N
                                        the forward pass raises (InjectedFault, as a device error
                                        would) on the N-th served step that runs one (N >= 1; the
                                        daemon's warm-up is not counted). The engine then fails as a
                                        whole: every stream UNAVAILABLE, health NOT_SERVING, exit 1
    --fault-nan-logits-request ID
                                        the logits row of request ID is NaN on every step that
                                        samples a token for it (so it fails at its first token);
                                        the engine ends that request alone (non-finite logits)
                                        and keeps serving. Honoured by the local forward passes
                                        (gpu_service, cpu_service Local iterations), not by
                                        Dense Assist iterations, whose logits stay on gpu_service

A bad value is refused at start in one line naming the flag (or the variable, or the key).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


_FLAG_PREFIX = "fault_"


class InjectedFault(RuntimeError):
    """Raised by an injected fault where a real one (a device error) would raise."""


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _request_id(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a request id, got an empty value")
    return text


_request_id.__name__ = "request id"


def _fault(parse: Callable[[str], Any], metavar: str, help: str) -> Any:
    """A fault field: off (None) unless its option is set; `parse` turns the text into the value."""
    return field(default=None, metadata={"parse": parse, "metavar": metavar, "help": help})


@dataclass(frozen=True)
class FaultConfig:
    kv_corrupt_layer: int | None = _fault(_int_at_least(0), "N", "outgoing KV layer N arrives damaged (data "
                                          "socket: one byte changed after its checksum; shared memory: torn, "
                                          "written reports the layers before it only)")
    kv_drop_layer: int | None = _fault(_int_at_least(0), "N", "outgoing KV layer N is never sent (data socket: "
                                       "the stream ends short; shared memory: left unwritten and out of written)")
    kv_cut_after_layers: int | None = _fault(_int_at_least(0), "N", "the sender gives up an outgoing KV transfer "
                                             "(data socket: before layer N; shared memory: after the copy, "
                                             "before saying written)")
    kv_shm_hold_ms: int | None = _fault(_int_at_least(0), "MS", "shared-memory KV path: hold the write lease "
                                        "this long after the copy")
    step_delay_ms: int | None = _fault(_int_at_least(0), "MS", "sleep this long inside every engine step")
    forward_raise_at_step: int | None = _fault(_int_at_least(1), "N", "the forward pass raises on the N-th "
                                               "served step (the engine then fails as a whole)")
    nan_logits_request: str | None = _fault(_request_id, "ID", "request ID's logits row is NaN whenever it "
                                            "samples (that request alone fails)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultConfig:
        """The faults set by the options add_fault_arguments added (absent ones: off)."""
        return cls(**{f.name: getattr(args, _FLAG_PREFIX + f.name, None) for f in dataclasses.fields(cls)})

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    @property
    def step_delay_s(self) -> float:
        return (self.step_delay_ms or 0) / 1e3

    def check_forward(self, num_forward_steps: int) -> None:
        """Called before the `num_forward_steps`-th forward pass (1-based); raises InjectedFault on the chosen one."""
        if self.forward_raise_at_step is not None and num_forward_steps == self.forward_raise_at_step:
            raise InjectedFault(f"fault injected: the forward pass raised at step {num_forward_steps}")


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per FaultConfig field: --fault-<field> (environment DUALPACE_FAULT_<FIELD>)."""
    group = parser.add_argument_group("fault injection (tests of failure handling; all off by default)")
    for config_field in dataclasses.fields(FaultConfig):
        meta = config_field.metadata
        group.add_argument(flag_name(config_field.name), type=meta["parse"], default=None, metavar=meta["metavar"],
                           help=meta["help"])


def flag_name(field_name: str) -> str:
    """The option of a FaultConfig field, e.g. --fault-step-delay-ms (DUALPACE_FAULT_STEP_DELAY_MS)."""
    return "--" + (_FLAG_PREFIX + field_name).replace("_", "-")
