"""Fault injection for tests of failure handling (never enabled by default).

Daemons read the environment once at start (`FaultConfig.from_environ`) and pass
the config to the parts that honour it; nothing reads the environment at import.

    DUALPACE_FAULT_KV_CORRUPT_CHUNK=N   flip a bit in outgoing KV chunk N
    DUALPACE_FAULT_KV_DROP_CHUNK=N      skip outgoing KV chunk N (a sequence gap)
    DUALPACE_FAULT_KV_CUT_AFTER=N       abandon an outgoing transfer after N chunks
    DUALPACE_FAULT_STEP_DELAY_MS=N      sleep N ms inside every engine step (a stalled step loop)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from dualpace.engine.kv_transfer import KvChunk
from dualpace.errors import InvalidArgument, Unavailable

_PREFIX = "DUALPACE_FAULT_"


@dataclass(frozen=True)
class FaultConfig:
    kv_corrupt_chunk: int | None = None
    kv_drop_chunk: int | None = None
    kv_cut_after: int | None = None
    step_delay_ms: int | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "FaultConfig":
        environ = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            name = _PREFIX + field.name.upper()
            if name in environ:
                try:
                    values[field.name] = int(environ[name])
                except ValueError:
                    raise InvalidArgument(name, f"expected an integer, got {environ[name]!r}") from None
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
