"""Fault injection for tests of failure handling (never enabled by default).

Daemons read the environment once at start (`FaultConfig.from_environ`) and pass
the config to the parts that honour it; nothing reads the environment at import.

    DUALPACE_FAULT_KV_CORRUPT_CHUNK=N   flip a bit in outgoing KV chunk N (N >= 0)
    DUALPACE_FAULT_KV_DROP_CHUNK=N      skip outgoing KV chunk N (a sequence gap)
    DUALPACE_FAULT_KV_CUT_AFTER=N       abandon an outgoing transfer after N chunks
    DUALPACE_FAULT_KV_SHM_HOLD_MS=N     on the shared-memory path, hold the write lease N ms
                                        after the copy, before saying written (kill tests)
    DUALPACE_FAULT_STEP_DELAY_MS=N      sleep N ms inside every engine step (a stalled step loop)
    DUALPACE_FAULT_FORWARD_RAISE_AT_STEP=N
                                        the forward pass raises (InjectedFault, as a device error
                                        would) on the N-th served step that runs one (N >= 1; the
                                        daemon's warm-up is not counted). The engine then fails as a
                                        whole: every stream UNAVAILABLE, health NOT_SERVING, exit 1
    DUALPACE_FAULT_NAN_LOGITS_REQUEST=ID
                                        the logits row of request ID is NaN on every step that
                                        samples a token for it (so it fails at its first token);
                                        the engine ends that request alone (non-finite logits)
                                        and keeps serving. Honoured by the local forward passes
                                        (gpu_service, cpu_service Local iterations), not by
                                        Dense Assist iterations, whose logits stay on gpu_service

A bad value is refused at start with InvalidArgument naming the variable.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dualpace.engine.transfer.kv_transfer import KvChunk
from dualpace.errors import InvalidArgument, Unavailable

_PREFIX = "DUALPACE_FAULT_"


class InjectedFault(RuntimeError):
    """Raised by an injected fault where a real one (a device error) would raise."""


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _non_empty(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a request id, got an empty value")
    return text


def _fault(parse: Callable[[str], Any]) -> Any:
    """A fault field: off (None) unless its variable is set; `parse` turns the text into the value."""
    return field(default=None, metadata={"parse": parse})


@dataclass(frozen=True)
class FaultConfig:
    kv_corrupt_chunk: int | None = _fault(_int_at_least(0))
    kv_drop_chunk: int | None = _fault(_int_at_least(0))
    kv_cut_after: int | None = _fault(_int_at_least(0))
    kv_shm_hold_ms: int | None = _fault(_int_at_least(0))
    step_delay_ms: int | None = _fault(_int_at_least(0))
    forward_raise_at_step: int | None = _fault(_int_at_least(1))
    nan_logits_request: str | None = _fault(_non_empty)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> FaultConfig:
        """Read DUALPACE_FAULT_<FIELD> for every field; raises InvalidArgument naming a bad variable."""
        environ = os.environ if environ is None else environ
        values = {}
        for config_field in dataclasses.fields(cls):
            name = variable_name(config_field.name)
            if name in environ:
                try:
                    values[config_field.name] = config_field.metadata["parse"](environ[name])
                except ValueError as exc:
                    raise InvalidArgument(name, str(exc)) from None
        return cls(**values)

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    @property
    def step_delay_s(self) -> float:
        return (self.step_delay_ms or 0) / 1e3

    def outgoing_chunk(self, chunk: KvChunk) -> KvChunk | None:
        """The chunk to send (possibly corrupted), None to skip it; raises to cut the transfer."""
        if self.kv_cut_after is not None and chunk.seq >= self.kv_cut_after:
            raise Unavailable(f"fault injected: KV transfer cut after {self.kv_cut_after} chunks")
        if chunk.seq == self.kv_drop_chunk:
            return None
        if chunk.seq == self.kv_corrupt_chunk:
            return dataclasses.replace(chunk, k=bytes([chunk.k[0] ^ 0x01]) + chunk.k[1:])
        return chunk

    def check_forward(self, num_forward_steps: int) -> None:
        """Called before the `num_forward_steps`-th forward pass (1-based); raises InjectedFault on the chosen one."""
        if self.forward_raise_at_step is not None and num_forward_steps == self.forward_raise_at_step:
            raise InjectedFault(f"fault injected: the forward pass raised at step {num_forward_steps}")


def variable_name(field_name: str) -> str:
    """The environment variable of a FaultConfig field, e.g. DUALPACE_FAULT_STEP_DELAY_MS."""
    return _PREFIX + field_name.upper()
