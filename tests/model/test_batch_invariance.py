"""Batch invariance of the CPU kernels: a row of activations gets bitwise the same output alone as
inside any batch the kernels take, for every variant this CPU runs. Greedy decoding of a request
then does not depend on which other requests share its steps (a migrated request, a solo run and
a batched run agree token for token), except where a product leaves the kernels for oneDNN
(above Kernels.dense_max_rows rows of a same-dtype dense matrix)."""

from __future__ import annotations

import pytest
import torch

from dualpace.model import cpu_kernels
from tests.model.test_cpu_kernels import kernels, one_region  # noqa: F401  (kernels: the per-variant fixture)
from tests.model.test_quant import weight


def assert_rows_invariant(kernels, x: torch.Tensor, w, max_rows: int, first_rows: int = 1) -> None:
    """Row i of every batch of first_rows..max_rows rows equals row i of the batch of first_rows
    (1: the row alone)."""
    base = kernels.linear(x[:first_rows].contiguous(), w, out_dtype=torch.float32)
    alone = [kernels.linear(x[i:i + 1].contiguous(), w, out_dtype=torch.float32) for i in range(max_rows)]
    for m in range(first_rows + 1, max_rows + 1):
        batch = kernels.linear(x[:m].contiguous(), w, out_dtype=torch.float32)
        for i in range(m):
            expected = base[i:i + 1] if i < first_rows else None
            if expected is None and first_rows == 1:
                expected = alone[i]
            if expected is not None:
                assert torch.equal(batch[i:i + 1], expected), f"row {i} of a batch of {m} differs"


@pytest.mark.parametrize("n,k", [(37, 576), (64, 100), (9, 33), (13, 80)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp32-over-bf16"])
def test_dense_rows_alone_equal_rows_in_a_batch(kernels, n, k, dtype):
    torch.manual_seed(n + k)
    x_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    w_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    x, w = torch.randn(32, k).to(x_dtype), torch.randn(n, k).to(w_dtype)
    if x_dtype == w_dtype == torch.bfloat16 and kernels.amx:
        # bf16 on AMX: rows 1..3 on the GEMV, 4..AMX_MAX_ROWS on the tiles, each range in one order
        # (bf16 compute is not batch-invariant across the two; fp32 compute is, below)
        amx_from = int(kernels.lib.dp_amx_min_rows(0))
        assert_rows_invariant(kernels, x, w, amx_from - 1)
        assert_rows_invariant(kernels, x, w, cpu_kernels.AMX_MAX_ROWS, first_rows=amx_from)
        return
    max_rows = kernels.dense_max_rows(x_dtype) if x_dtype == w_dtype else cpu_kernels.MIXED_MAX_ROWS
    assert_rows_invariant(kernels, x, w, max_rows)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_quantized_rows_alone_equal_rows_in_a_batch(kernels, name):
    n, k = 21, 512
    w, _ = weight(name, n, k)
    if not kernels.supports_format(w.kernel_desc()[0]):
        pytest.skip(f"{name} has no kernel in variant {kernels.variant}")
    torch.manual_seed(1)
    assert_rows_invariant(kernels, torch.randn(16, k), w, 16)


def test_decode_attention_sequences_alone_equal_sequences_in_a_batch(kernels):
    torch.manual_seed(0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 64, 6, 2, 64
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    lens = torch.tensor([5, 40, 130, 300])
    tables = torch.stack([torch.randperm(num_blocks)[:32] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim)
    batch = kernels.decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
    for i in range(len(lens)):
        alone = kernels.decode_attention(q[i:i + 1].contiguous(), k_cache, v_cache, tables[i:i + 1].contiguous(),
                                         lens[i:i + 1].contiguous(), head_dim ** -0.5)
        assert torch.equal(batch[i:i + 1], alone), f"sequence {i} (context {int(lens[i])})"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp32-over-bf16", "Q8_0"])
def test_decode_rows_beside_a_prefill_get_what_they_get_alone(kernels, dtype):
    """A step that mixes a prefill with decode rows goes to oneDNN as a whole (more rows than the
    kernel takes); its decode rows (kernel_rows) still get the kernel's outputs, bitwise."""
    torch.manual_seed(2)
    n, k = 48, 256
    x_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if dtype == "Q8_0":
        w, _ = weight("Q8_0", n, k)
    else:
        w = torch.randn(n, k).to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    x = torch.randn(200, k).to(x_dtype)
    residual = torch.randn(200, n).to(x_dtype)
    decode_rows = torch.tensor([0, 7, 130, 199])
    mixed = kernels.linear(x, w, residual=residual, out_dtype=torch.float32, kernel_rows=decode_rows)
    alone = kernels.linear(x[decode_rows], w, residual=residual[decode_rows], out_dtype=torch.float32)
    assert torch.equal(mixed[decode_rows], alone)
    if not (dtype == "bf16" and kernels.amx):  # bf16 on AMX: 4 rows take the tiles, 1 the GEMV
        for i in decode_rows.tolist():
            one = kernels.linear(x[i:i + 1], w, residual=residual[i:i + 1], out_dtype=torch.float32)
            assert torch.equal(mixed[i:i + 1], one), f"decode row {i}"
    others = torch.ones(200, dtype=torch.bool)
    others[decode_rows] = False  # the prefill rows keep torch's outputs
    plain = kernels.linear(x, w, residual=residual, out_dtype=torch.float32)
    assert torch.equal(mixed[others], plain[others])


@pytest.mark.parametrize("dtype,weights", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-mistral"])
def test_lone_sequence_step_in_one_region_equals_per_operation(kernels, preset, dtype, weights, synth_checkpoint):
    """A lone sequence's step in one region runs RoPE, the KV write and attention as one task per
    kv head (cpu_kernels.cpp rope_kv_attend_head); per operation they run over all heads at once.
    Logits and the cache rows written are bitwise the same."""
    from dualpace.model.loader import load_model

    loaded = load_model(str(synth_checkpoint(preset)), dtype=dtype, weights=weights)
    model, cfg = loaded.model, loaded.config
    results = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the per-head tasks need more than one thread (tests run on one)
    try:
        _lone_steps(kernels, model, cfg, results)
    finally:
        torch.set_num_threads(before)
    (logits_1, k_1, v_1), (logits_0, k_0, v_0) = results
    assert torch.equal(logits_1, logits_0)
    assert torch.equal(k_1, k_0) and torch.equal(v_1, v_0)


def _lone_steps(kernels, model, cfg, results):
    from dualpace.kv.storage import KVStorage
    from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors

    for in_one_region in (True, False):
        torch.manual_seed(3)
        kv = KVStorage(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        kv.k.normal_()
        kv.v.normal_()
        forward = PagedForward(model, kv)
        step = build_step_tensors([SequenceWork([7], 29, list(range(2, 10)))], kv.block_size, kv.device)
        if forward._fused_decode(step) is None:
            pytest.skip("head_dim not covered by the fused kernels")
        with one_region(kernels, in_one_region):
            logits = forward.forward_tensors(step)
        results.append((logits, kv.k.clone(), kv.v.clone()))
