"""Content hashes of full KV blocks, chained over the prefix: pure, no tensors.

A block's hash is SHA-256 over (its parent block's hash, its token ids as little-endian
uint32), and the first block's parent is a root derived from a salt naming the model and
its weights format. So two blocks hash equal only when the whole prefix up to and
including them is the same token sequence under the same weights: reusing the KV of one
for the other is exact. Only full blocks are hashed; a partial last block never is.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from dualpace.kv.allocator import BlockHash

HASH_VERSION = b"dualpace-prefix-v1"


class BlockHasher:
    """Hashes full blocks of ``block_size`` tokens under one model salt."""

    def __init__(self, block_size: int, salt: str):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.salt = salt
        self.root_hash: BlockHash = hashlib.sha256(HASH_VERSION + b"\0" + salt.encode()).digest()

    def hash_block(self, parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
        """Hash of one full block whose predecessor hashes to ``parent_hash`` (None: the first block)."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a full block has {self.block_size} tokens, got {len(token_ids)}")
        return _chained(self.root_hash if parent_hash is None else parent_hash,
                        struct.pack(f"<{len(token_ids)}I", *token_ids))

    def extend(self, block_hashes: list[BlockHash], token_ids: Sequence[int]) -> None:
        """Append to ``block_hashes`` (the chain of ``token_ids``' first blocks) every further
        full block of ``token_ids`` (hash_block's hashes, the tokens packed once for all the blocks:
        an imported 1024-token request's 64 blocks took 129 -> 71 us hot, 215 -> 127 us cold)."""
        size = self.block_size
        first, end = len(block_hashes), len(token_ids) // size
        if end <= first:
            return
        packed = struct.pack(f"<{(end - first) * size}I", *token_ids[first * size:end * size])
        parent = block_hashes[-1] if block_hashes else self.root_hash
        block_bytes = 4 * size
        for offset in range(0, len(packed), block_bytes):
            parent = _chained(parent, packed[offset:offset + block_bytes])
            block_hashes.append(parent)

    def chain(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids``, in order."""
        block_hashes: list[BlockHash] = []
        self.extend(block_hashes, token_ids)
        return block_hashes


def _chained(parent_hash: BlockHash, packed_tokens: bytes) -> BlockHash:
    """SHA-256 over a parent block's hash and one block's token ids packed as little-endian uint32."""
    digest = hashlib.sha256(parent_hash)
    digest.update(packed_tokens)
    return digest.digest()
