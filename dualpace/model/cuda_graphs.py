"""Capture and replay of decode steps as CUDA graphs: the thin CUDA-only layer under
dualpace.model.static_decode (which owns the static buffers and decides what replays).

Each bucket's step runs twice eagerly on a side stream first (Triton compiles its kernels, cuBLAS
picks its algorithms, the caching allocator settles), then is captured; every bucket shares one
graph memory pool, the largest captured first so the smaller ones fit inside its blocks. A replay
reads whatever the static buffers hold at that moment and writes the same output tensor.
"""

from __future__ import annotations

import torch

from dualpace.model.paged_forward import PagedForward

NUM_WARMUP_RUNS = 2


class CapturedDecode:
    """One bucket's captured step; `replay()` returns its logits tensor (the same one every time)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor):
        self.graph = graph
        self.logits = logits

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


@torch.inference_mode()
def capture_all(forward: PagedForward, steps: dict) -> dict[int, CapturedDecode]:
    """steps: bucket -> StaticDecodeStep, already filled with padding rows only."""
    if forward.model.device.type != "cuda":
        raise ValueError("CUDA graphs need the model on a CUDA device")
    between_layers, forward.between_layers = forward.between_layers, None  # no hand-off inside a capture
    try:
        pool = torch.cuda.graph_pool_handle()
        captured = {}
        for bucket in sorted(steps, reverse=True):
            step = steps[bucket].step
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(NUM_WARMUP_RUNS):
                    forward.forward_tensors(step)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward.forward_tensors(step)
            captured[bucket] = CapturedDecode(graph, logits)
        torch.cuda.synchronize()
        return captured
    finally:
        forward.between_layers = between_layers
