"""What a transfer sends: the source pool and the request's slots, which the transports copy
(shared memory) or stream (the data socket) straight from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dualpace.kv.storage import KVStorage


@dataclass
class OutgoingKv:
    storage: KVStorage
    slot_ids: list[int]  # the slots of the tokens sent, in token order
    # Called between layers where the transport streams them (the data socket) and once before the
    # commit: raises to abandon the move (a cancelled MigrateOut)
    safe_point: Callable[[], None] = lambda: None
