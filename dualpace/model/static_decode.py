"""Decode steps through static input buffers, one set per batch-size bucket (dualpace.model.decode_buckets).

`StaticDecodeStep` owns one bucket's buffers on the model's device (token ids, positions, slot ids,
context lengths and start positions, views of one int64 tensor filled by one host->device copy;
block tables, of which a step fills its own columns with a second) and the StepTensors that
point at them. `DecodeGraphs` routes a step:
a decode-only step that fits a bucket is padded into that bucket's buffers and run there, by
replaying its captured CUDA graph (dualpace.model.cuda_graphs) on CUDA, or eagerly on the same
buffers elsewhere (how the CPU tests check that padding changes no real row's result); any other
step returns None and the caller runs it eagerly. Where the sliding layers hold a KV pool of their
own (KVStorage.has_window_pool), each bucket has a second set of slot ids and block tables for
that pool, with its own scratch block (StepTensors.window_pool).
"""

from __future__ import annotations

import logging

import torch

from dualpace.kv.block_table import readable_block_ids
from dualpace.model.attention_backend import uses_triton
from dualpace.model.decode_buckets import DecodeRow, PaddedDecode, bucket_for, decode_buckets, pad_decode
from dualpace.model.paged_forward import PagedForward, SequenceWork, StepTensors
from dualpace.model.triton_attention import VarlenBatch

log = logging.getLogger(__name__)
NUM_ROW_FIELDS = 5  # token_ids, positions, slot_ids, context_lens, start positions (PaddedDecode.packed_rows)


class StaticDecodeStep:
    """The fixed-address inputs of one bucket's decode step."""

    def __init__(self, bucket: int, table_width: int, device: torch.device, with_window_pool: bool = False):
        """with_window_pool: a second set of buffers (`window`) for the sliding layers' own pool."""
        self.bucket = bucket
        self.table_width = table_width
        self.row_fields = torch.zeros(NUM_ROW_FIELDS * bucket, dtype=torch.long, device=device)
        token_ids, positions, slot_ids, context_lens, start_pos = self.row_fields.view(NUM_ROW_FIELDS, bucket)
        # zeros: block 0, a valid id, until a step writes its columns
        self.block_tables = block_tables = torch.zeros((bucket, table_width), dtype=torch.long, device=device)
        rows = torch.arange(bucket, dtype=torch.long, device=device)
        varlen = None
        if uses_triton(device):
            query_start = torch.arange(bucket + 1, dtype=torch.long, device=device)
            varlen = VarlenBatch(query_start=query_start, start_pos=start_pos, block_tables=block_tables,
                                 max_new_tokens=1)
        self.step = StepTensors(
            token_ids=token_ids, positions=positions, slot_ids=slot_ids, decode_token_index=rows,
            decode_block_tables=block_tables, decode_context_lens=context_lens, prefills=[],
            logit_token_index=rows, varlen=varlen)
        self.window = StaticDecodeStep(bucket, table_width, device) if with_window_pool else None
        if self.window is not None:
            self.step.window_pool = self.window.step

    def fill(self, padded: PaddedDecode, padded_window: PaddedDecode | None = None) -> None:
        """Copy the step's rows in (padded_window: the same rows over the sliding pool, with one)."""
        if self.window is not None:
            self.window.fill(padded_window)
        num_columns = len(padded.block_tables[0])
        if padded.bucket != self.bucket or num_columns > self.table_width:
            raise ValueError(f"a step of {padded.bucket} rows and {num_columns} table columns does not fit the "
                             f"buffers of bucket {self.bucket} ({self.table_width} columns)")
        self.row_fields.copy_(torch.tensor(padded.packed_rows(), dtype=torch.long))
        self.block_tables[:, :num_columns].copy_(torch.tensor(padded.block_tables, dtype=torch.long))


def decode_rows(work: list[SequenceWork], window_pool: bool = False) -> list[DecodeRow] | None:
    """The step as decode rows (window_pool: over the sliding layers' tables), or None when a sequence
    brings more than one token (prefill). Entries a window released read a held block (masked)."""
    if any(len(seq.token_ids) != 1 for seq in work):
        return None
    return [DecodeRow(seq.token_ids[0], seq.start_pos,
                      readable_block_ids(seq.window_block_ids if window_pool else seq.block_ids)) for seq in work]


class DecodeGraphs:
    """Decode-only steps of up to `max_batch` sequences through static buffers (see the module doc).

    The KV pool must have a block no sequence owns: `scratch_block`, where padding rows write; a
    sliding layers' pool of their own too: `window_scratch_block`."""

    def __init__(self, forward: PagedForward, max_batch: int, table_width: int, scratch_block: int,
                 window_scratch_block: int | None = None):
        self.forward = forward
        self.table_width = table_width
        self.scratch_block = scratch_block
        self.window_scratch_block = window_scratch_block
        if forward.kv.has_window_pool and window_scratch_block is None:
            raise ValueError("a KV storage with a sliding pool needs that pool's scratch block too")
        self.buckets = decode_buckets(max_batch)
        device = forward.model.device
        self.steps = {b: StaticDecodeStep(b, table_width, device, forward.kv.has_window_pool) for b in self.buckets}
        self.captured: dict = {}  # bucket -> CapturedDecode, once capture() ran (CUDA only)
        self.num_static_steps = 0  # steps run through the buffers (replayed, on CUDA)
        self.num_eager_steps = 0  # steps that did not fit a bucket

    def capture(self) -> None:
        """Capture every bucket's graph, largest first, in one memory pool (CUDA only)."""
        from dualpace.model.cuda_graphs import capture_all

        block_size = self.forward.kv.block_size
        for bucket, static in self.steps.items():  # only padding rows: warm-up and capture touch the scratch block
            window = None if static.window is None else pad_decode([], bucket, self.table_width, block_size,
                                                                   self.window_scratch_block)
            static.fill(pad_decode([], bucket, self.table_width, block_size, self.scratch_block), window)
        self.captured = capture_all(self.forward, self.steps)
        log.info("captured CUDA graphs for decode batch sizes %s", ",".join(map(str, self.buckets)))

    def run(self, work: list[SequenceWork]) -> torch.Tensor | None:
        """Logits [len(work), vocab] of a decode-only step that fits a bucket, or None (run it eagerly).
        On CUDA the rows are views of the graph's output, valid until its next replay."""
        rows = decode_rows(work)
        bucket = None if rows is None else bucket_for(len(rows), self.buckets)
        block_size = self.forward.kv.block_size
        padded = None if bucket is None else pad_decode(rows, bucket, self.table_width, block_size, self.scratch_block)
        padded_window = None
        if padded is not None and self.window_scratch_block is not None:
            padded_window = pad_decode(decode_rows(work, window_pool=True), bucket, self.table_width, block_size,
                                       self.window_scratch_block)
        if padded is None or (self.window_scratch_block is not None and padded_window is None):
            self.num_eager_steps += 1
            return None
        static = self.steps[bucket]
        static.fill(padded, padded_window)
        captured = self.captured.get(bucket)
        if captured is not None:
            if self.forward.between_layers is not None:  # a replay has no point between layers to yield at
                self.forward.between_layers()
            logits = captured.replay()
        else:
            logits = self.forward.forward_tensors(static.step)
        self.num_static_steps += 1
        return logits[: padded.num_real]
