"""Decode steps padded to a batch-size bucket, for replay through a captured CUDA graph (pure; no torch).

A CUDA graph replays fixed shapes from fixed addresses, so a decode-only step of `n` sequences
runs as a step of `bucket >= n` rows whose inputs are copied into static buffers, block tables
`table_width` blocks wide, and the `bucket - n` padding rows pointed at a scratch block that no
sequence owns (the runner's KV pool has one block more than its allocator hands out). A padding row reads
token 0 at position 0 and writes its K/V into the scratch block's first slot; its logits are
dropped. Only the step's own table columns are copied (as many as its longest context spans):
attention never reads a table past a row's context, and the columns beyond keep block ids of
earlier steps, valid ids that the context lengths mask. dualpace.model.static_decode holds the buffers; dualpace.model.cuda_graphs captures them.

A step that does not fit (a prefill chunk, more sequences than the largest bucket, a block table
wider than the buffers) returns None from `pad_decode` and runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8  # above the small ones, every multiple of 8: padding wastes at most 7 rows


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured for at most `max_batch` decode sequences: 1, 2, 4, then multiples of 8,
    and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    buckets = {b for b in SMALL_BUCKETS if b <= max_batch}
    buckets.update(range(BUCKET_STEP, max_batch + 1, BUCKET_STEP))
    buckets.add(max_batch)
    return sorted(buckets)


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows (buckets sorted), or None when none does."""
    for bucket in buckets:
        if bucket >= num_seqs:
            return bucket
    return None


def table_width_blocks(max_context_tokens: int, block_size: int, num_blocks: int) -> int:
    """Blocks per static block-table row: a sequence of the longest context fits, the pool permitting."""
    return max(1, min(num_blocks, -(-max_context_tokens // block_size)))


@dataclass(frozen=True)
class DecodeRow:
    """One decode sequence: its new token at `position`, with its block table."""

    token_id: int
    position: int
    block_ids: list[int]


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step as `bucket` rows; rows [0, num_real) are the real sequences, in order."""

    num_real: int
    token_ids: list[int]
    positions: list[int]
    slot_ids: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # bucket rows of the step's columns: as many as its longest context spans

    @property
    def bucket(self) -> int:
        return len(self.token_ids)

    def packed_rows(self) -> list[int]:
        """The per-row fields in the static buffer's order: token_ids, positions, slot_ids,
        context_lens, start positions (one host->device copy)."""
        start_pos = [n - 1 for n in self.context_lens]
        return self.token_ids + self.positions + self.slot_ids + self.context_lens + start_pos


def pad_decode(rows: list[DecodeRow], bucket: int, table_width: int, block_size: int,
               scratch_block: int) -> PaddedDecode | None:
    """`rows` padded to `bucket` rows, or None when a sequence's context spans more than
    `table_width` blocks or there are more rows than the bucket holds."""
    if len(rows) > bucket:
        return None
    num_columns = max((row.position // block_size + 1 for row in rows), default=1)
    token_ids, positions, slot_ids, context_lens, tables = [], [], [], [], []
    for row in rows:
        num_blocks = row.position // block_size + 1  # the blocks the context, the new token included, spans
        if num_blocks > table_width or len(row.block_ids) < num_blocks:
            return None
        token_ids.append(row.token_id)
        positions.append(row.position)
        slot_ids.append(row.block_ids[row.position // block_size] * block_size + row.position % block_size)
        context_lens.append(row.position + 1)
        tables.append(row.block_ids[:num_blocks] + [scratch_block] * (num_columns - num_blocks))
    num_padding = bucket - len(rows)
    return PaddedDecode(
        num_real=len(rows),
        token_ids=token_ids + [0] * num_padding,
        positions=positions + [0] * num_padding,
        slot_ids=slot_ids + [scratch_block * block_size] * num_padding,
        context_lens=context_lens + [1] * num_padding,
        block_tables=tables + [[scratch_block] * num_columns for _ in range(num_padding)],
    )
