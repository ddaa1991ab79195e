"""KV transfer between engines: chunking, checksums, and the import bookkeeping.

A request's KV travels as chunks of one layer and a token range each, carrying
K and V bytes and a CRC32C of both (kv_checksum.py). The target verifies sequence numbers,
ranges and checksums as chunks arrive, writes them into blocks it reserved
for the request, and only on commit makes the request live. Torch-free (the bytes <->
tensor helpers are in kv_bytes.py, so the wire and the router read these types without
torch); no grpc here (see the servicers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dualpace.engine.transfer.kv_checksum import kv_checksum
from dualpace.errors import InvalidArgument
from dualpace.sampling_params import SamplingParams

ITEMSIZE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the KV dtypes a transfer carries
DEFAULT_CHUNK_BYTES = 4 * 2**20  # K + V bytes per chunk, well under the gRPC message limit


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
    total_chunks: int
    total_bytes: int
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


@dataclass(frozen=True)
class KvChunk:
    seq: int
    layer: int
    token_start: int
    token_end: int
    k: bytes  # or, on the sending side, any byte buffer (a memoryview of the exported tensor)
    v: bytes
    crc32: int  # CRC32C of k then v (kv_checksum)


checksum = kv_checksum  # the name the transports use


def token_ranges(num_tokens: int, layout: KvLayout, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 first_token: int = 0) -> list[tuple[int, int]]:
    """Token ranges of one layer's chunks from `first_token` on, each at most `chunk_bytes` of K + V."""
    tokens_per_chunk = max(1, chunk_bytes // (2 * layout.bytes_per_token_per_layer))
    return [(start, min(start + tokens_per_chunk, num_tokens))
            for start in range(first_token, num_tokens, tokens_per_chunk)]


def plan_chunks(num_tokens: int, layout: KvLayout, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                first_token: int = 0) -> list[tuple[int, int, int]]:
    """(layer, token_start, token_end) of every chunk, in sending order (tokens before `first_token`:
    none, the target holds them)."""
    ranges = token_ranges(num_tokens, layout, chunk_bytes, first_token)
    return [(layer, start, end) for layer in range(layout.num_layers) for start, end in ranges]


@dataclass
class ImportProgress:
    """Target-side verification of an incoming transfer, chunk by chunk."""

    header: KvTransferHeader
    next_seq: int = 0
    num_bytes: int = 0
    covered: dict[int, int] = field(default_factory=dict)  # layer -> tokens received contiguously
    # Tokens the target holds already (a cache-only import with skip_cached): chunks start there,
    # and the header's totals count only the tokens from there on (skip_held sets both).
    first_token: int = 0

    def skip_held(self, num_held_tokens: int) -> None:
        """Expect only tokens num_held_tokens .. num_computed_tokens - 1 (the rest is held here).
        The chunk count then depends on the sender's chunk size, so completeness is the
        per-layer coverage and the byte count; sequence numbers stay contiguous from 0."""
        header = self.header
        if not 0 <= num_held_tokens <= header.num_computed_tokens:
            raise InvalidArgument("num_held_tokens", f"{num_held_tokens} outside 0..{header.num_computed_tokens}")
        self.first_token = num_held_tokens
        num_sent = header.num_computed_tokens - num_held_tokens
        self.header = replace(header, total_chunks=-1,
                              total_bytes=2 * header.layout.num_layers * num_sent * header.layout.bytes_per_token_per_layer)

    def check_chunk(self, chunk: KvChunk) -> None:
        """Raise InvalidArgument naming the problem for an out-of-order, out-of-range or corrupt chunk."""
        self.check_order(chunk)
        self.check_checksum(chunk)

    def check_order(self, chunk: KvChunk) -> None:
        """The cheap part of check_chunk: sequence number, layer and token range."""
        header = self.header
        if chunk.seq != self.next_seq:
            raise InvalidArgument("chunk.seq", f"expected chunk {self.next_seq}, got {chunk.seq} (a gap or repeat)")
        if not 0 <= chunk.layer < header.layout.num_layers:
            raise InvalidArgument("chunk.layer", f"layer {chunk.layer} out of range")
        start_expected = self.covered.get(chunk.layer, self.first_token)
        if chunk.token_start != start_expected or not chunk.token_start < chunk.token_end <= header.num_computed_tokens:
            raise InvalidArgument(
                "chunk.token_start",
                f"chunk covers tokens [{chunk.token_start}, {chunk.token_end}) of layer {chunk.layer}; "
                f"expected to start at {start_expected} and end by {header.num_computed_tokens}",
            )

    @staticmethod
    def check_checksum(chunk: KvChunk) -> None:
        """The CRC32C of K + V (kv_checksum; it releases the GIL on large buffers)."""
        if checksum(chunk.k, chunk.v) != chunk.crc32:
            raise InvalidArgument("chunk.crc32", f"checksum mismatch in chunk {chunk.seq}")

    def accept(self, chunk: KvChunk) -> None:
        self.covered[chunk.layer] = chunk.token_end
        self.next_seq += 1
        self.num_bytes += len(chunk.k) + len(chunk.v)

    def accept_in_place(self) -> None:
        """Every layer was written straight into the reserved blocks and verified (same host)."""
        if self.next_seq != 0:
            raise InvalidArgument("shm_written", f"{self.next_seq} chunks were already sent over the stream")
        header = self.header
        self.covered = {layer: header.num_computed_tokens for layer in range(header.layout.num_layers)}
        self.next_seq = header.total_chunks
        self.num_bytes = header.total_bytes

    def check_complete(self) -> None:
        header = self.header
        if header.total_chunks >= 0 and self.next_seq != header.total_chunks:  # -1: skip_held
            raise InvalidArgument("prepare", f"received {self.next_seq} of {header.total_chunks} chunks")
        for layer in range(header.layout.num_layers):
            if self.covered.get(layer, self.first_token) != header.num_computed_tokens:
                raise InvalidArgument("prepare", f"layer {layer} has {self.covered.get(layer, self.first_token)} of "
                                                 f"{header.num_computed_tokens} tokens")
        if self.num_bytes != header.total_bytes:
            raise InvalidArgument("prepare", f"received {self.num_bytes} of {header.total_bytes} bytes")
