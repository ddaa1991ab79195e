"""The messages of a same-host KV transfer, beside the header of kv_transfer.py (torch-free).

Over the import stream: the header carries an offer (the sender's boot id; over a watch, also
a lease ticket of the sender's, whose lease it asks for ahead: dualpace.engine.transfer.same_host); the target
answers with a reservation (where its pool is, which slots to write, the tickets) or a
refusal with its reason (then the data socket, where the header offered it too); after writing, the sender says so
with the layer checksums. Where the target's reservation allows it, prepare and commit ride
on that same message (`ShmWritten.commit`): the target verifies, prepares and commits in one
go and answers with committed alone; otherwise prepare and commit follow as separate messages.

Where the reservation says `reserves_ahead`, a sender may reserve the blocks of its next transfer
before that transfer exists (`ShmReserveAhead` instead of a header, answered by a reservation);
the transfer then copies at once, and sends its header and written + commit together.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpace.engine.transfer.kv_transfer import KvLayout


@dataclass(frozen=True)
class ShmOffer:
    boot_id: str
    lease_ticket: bytes | None = None  # the sender's own lease ticket, asked for ahead (same_host.KIND_ASK)


@dataclass(frozen=True)
class ShmReservation:
    socket_name: str  # abstract Unix socket of the target's dualpace.engine.transfer.same_host.TicketServer
    segment_token: bytes  # ticket for the pool's memfd; also the token in its header
    import_token: bytes  # ticket for this import's write lease
    # Target slots of tokens 0 .. num_computed_tokens - 1, as (first slot, number of slots) runs of
    # consecutive slots in token order (KVBlockManager.slot_runs; runs_into pairs them with the source)
    slot_runs: tuple[tuple[int, int], ...]
    accepts_written_with_commit: bool = False  # the target takes ShmWritten(commit=True)
    lease_on_watch: bool = False  # the target grants the write lease over the sender's watch connection
    control_on_watch: bool = False  # later transfers may run their messages over that watch (shm_control)
    asks_lease_ahead: bool = False  # later transfers over that watch may ask for their lease ahead (ShmOffer)
    reserves_ahead: bool = False  # later transfers over that watch may reserve their blocks ahead (ShmReserveAhead)


@dataclass(frozen=True)
class ShmReserveAhead:
    """Reserve `num_tokens` slots now for a transfer to come (of at most that many tokens of KV)."""

    layout: KvLayout
    num_tokens: int
    offer: ShmOffer


@dataclass(frozen=True)
class ShmDeclined:
    reason: str


@dataclass(frozen=True)
class ShmWritten:
    layer_crc32s: tuple[int, ...]  # dualpace.engine.transfer.shm_kv_copy.layer_checksums
    commit: bool = False  # prepare and commit in this same message (one round trip instead of two)
