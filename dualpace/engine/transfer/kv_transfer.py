"""KV transfer between engines: the header, the layout, and the target's import bookkeeping.

A transfer moves every layer's K and V of the tokens sent (0 .. num_computed_tokens - 1, or from
the first one a cache-only target does not hold) straight into the target's reserved blocks:
through shared memory (same host, kv_shm_send.py) or over the target's TCP data socket
(kv_tcp_data.py). Either way the target compares a CRC32C per layer (kv_checksum.py) over what
landed with the sender's before anything is committed, and only on commit makes the request live. Torch-free (the bytes <-> tensor helpers are in kv_bytes.py,
so the wire and the router read these types without torch); no grpc here (see the servicers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dualpace.errors import InvalidArgument
from dualpace.sampling_params import SamplingParams

ITEMSIZE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the KV dtypes a transfer carries


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K or V bytes of one token in one layer."""
        return self.num_kv_heads * self.head_dim * ITEMSIZE_BYTES[self.dtype]


@dataclass(frozen=True)
class KvTransferHeader:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams  # seed set: the request's fixed seed
    num_computed_tokens: int  # tokens whose KV is sent: all but the last
    layout: KvLayout
    total_bytes: int  # K + V bytes of every layer of the tokens sent
    source_engine: str
    num_cached_tokens: int = 0  # prompt tokens the source served from its prefix cache
    cache_only: bool = False  # host tier: prefix-cache blocks, not a live request (dualpace.engine.transfer.host_tier)
    cache_salt: str = ""  # with cache_only: the source's prefix-cache salt
    num_prior_output_tokens: int = 0  # the prompt's last tokens that were output before a re-submission
    # With cache_only: the target first answers which leading tokens it caches already
    # (cache_held) and the sender sends only the rest (dualpace.engine.transfer.prefix_copy).
    skip_cached: bool = False


@dataclass(frozen=True)
class PrefixCopy:
    """What one cache-only transfer of a cached prefix did (dualpace.engine.transfer.prefix_copy)."""

    num_tokens: int  # leading tokens the target caches now from this transfer
    num_sent_tokens: int  # of those, the tokens whose KV was sent (the rest the target held already)
    target_engine: str
    last_block_hash: bytes = b""  # the sender's hash of the prefix's last block


@dataclass
class ImportProgress:
    """Target-side state of an incoming transfer: what it expects, and whether what landed was verified."""

    header: KvTransferHeader
    # Tokens the target holds already (a cache-only import with skip_cached): the sender sends only
    # the tokens from there on, and the header's total_bytes counts only those (skip_held sets both).
    first_token: int = 0
    verified: bool = False  # every layer landed and its checksum matched the sender's

    def skip_held(self, num_held_tokens: int) -> None:
        """Expect only tokens num_held_tokens .. num_computed_tokens - 1 (the rest is held here)."""
        header = self.header
        if not 0 <= num_held_tokens <= header.num_computed_tokens:
            raise InvalidArgument("num_held_tokens", f"{num_held_tokens} outside 0..{header.num_computed_tokens}")
        self.first_token = num_held_tokens
        num_sent = header.num_computed_tokens - num_held_tokens
        self.header = replace(header, total_bytes=2 * header.layout.num_layers * num_sent
                              * header.layout.bytes_per_token_per_layer)

    @property
    def num_expected_tokens(self) -> int:
        """Tokens whose KV the sender sends (0: none, the request moves without KV or all is held)."""
        return self.header.num_computed_tokens - self.first_token

    def accept_in_place(self) -> None:
        """Every layer landed in the reserved blocks and matched the sender's checksums."""
        self.verified = True

    @property
    def num_bytes(self) -> int:
        """K + V bytes received and verified."""
        return self.header.total_bytes if self.verified else 0

    def check_complete(self) -> None:
        if self.num_expected_tokens > 0 and not self.verified:
            raise InvalidArgument("prepare", f"the KV of {self.num_expected_tokens} tokens has not landed and been "
                                             "verified (no shm_written or tcp_written)")
