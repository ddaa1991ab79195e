"""The grouped expert call (dualpace.model.cpu_moe, cpu_moe.h) against the per-expert path on the same
kernels (dualpace.model.moe.routed_experts with Kernels.linear and Kernels.silu_mul): bitwise equal
in every weight format, compute dtype, activation mode and ISA variant, since each expert's products
are those one Kernels.linear call makes for its rows; unselected experts never read; bad ids refused."""

from __future__ import annotations

import pytest
import torch

from dualpace.model import quant_activations
from dualpace.model.cpu_moe import GroupedExperts
from dualpace.model.moe import MoeWeights, route, routed_experts
from dualpace.model.moe_spec import MoeSpec
from tests.model.test_cpu_kernels import kernels  # noqa: F401  (the per-variant fixture)
from tests.model.test_quant import weight

NUM_EXPERTS, TOP_K = 16, 4


def _experts(fmt: str, hidden: int, ffn: int, seed: int) -> MoeWeights:
    """Random experts in `fmt` (a block format, or fp32 / bf16 tensors) and an fp32 router."""
    generator = torch.Generator().manual_seed(seed)

    def matrix(n: int, k: int, i: int):
        if fmt in ("fp32", "bf16"):
            m = torch.randn(n, k, generator=generator) * 0.05
            return m.to(torch.bfloat16 if fmt == "bf16" else torch.float32)
        return weight(fmt, n, k, seed=seed * 1000 + i)[0]

    return MoeWeights(torch.randn(NUM_EXPERTS, hidden, generator=generator),
                      [matrix(2 * ffn, hidden, 2 * e) for e in range(NUM_EXPERTS)],
                      [matrix(hidden, ffn, 2 * e + 1) for e in range(NUM_EXPERTS)])


def _per_expert(kernels, x, weights, spec, top_weights, top_ids):
    def matmul(rows, w, kernel_rows):
        return kernels.linear(rows, w)

    return routed_experts(x, weights, spec, top_weights, top_ids, matmul, None, kernels.silu_mul)


@pytest.fixture(params=["int16", "int8"])
def mode(request):
    quant_activations.set_activations(request.param)
    yield request.param
    quant_activations.set_activations("int16")


@pytest.mark.parametrize("fmt,hidden,ffn", [("Q8_0", 96, 64), ("Q4_K", 256, 256), ("Q6_K", 256, 512),
                                            ("Q4_0", 64, 96), ("fp32", 48, 40), ("bf16", 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 32])
def test_grouped_call_equals_the_per_expert_path(kernels, mode, fmt, hidden, ffn, dtype, num_rows):  # noqa: F811
    weights = _experts(fmt, hidden, ffn, seed=num_rows)
    spec = MoeSpec(NUM_EXPERTS, TOP_K, ffn, norm_topk_prob=True)
    grouped = GroupedExperts.build(kernels, weights)
    if grouped is None:
        pytest.skip(f"{fmt} has no kernel in {kernels.variant}")
    x = (torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    top_weights, top_ids = route(x, weights.router.to(dtype), spec, lambda r, w, _: kernels.linear(r, w))
    amx_before = kernels.set_amx(False)  # dense bf16 x bf16 per-expert calls would take AMX tiles from 4 rows
    try:
        busiest = int(torch.bincount(top_ids.reshape(-1)).max())
        if not grouped.applies(x, top_ids, NUM_EXPERTS):  # an expert's rows would leave the kernels (oneDNN)
            assert busiest > grouped.max_rows_per_expert(dtype)
            return
        expected = _per_expert(kernels, x, weights, spec, top_weights, top_ids)
        ours = grouped.run(x, top_ids, top_weights)
    finally:
        kernels.set_amx(amx_before)
    assert torch.equal(ours, expected), (ours.float() - expected.float()).abs().max()


def test_unselected_experts_are_never_read(kernels):  # noqa: F811
    """Every expert no row chose holds NaNs: the output stays finite."""
    weights = _experts("fp32", 64, 32, seed=5)
    spec = MoeSpec(NUM_EXPERTS, TOP_K, 32, norm_topk_prob=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    top_weights, top_ids = route(x, weights.router, spec, lambda r, w, _: kernels.linear(r, w))
    chosen = set(top_ids.reshape(-1).tolist())
    assert len(chosen) < NUM_EXPERTS
    for e in set(range(NUM_EXPERTS)) - chosen:
        weights.expert_gate_up[e].fill_(float("nan"))
        weights.expert_down[e].fill_(float("nan"))
    out = GroupedExperts.build(kernels, weights).run(x, top_ids, top_weights)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _per_expert(kernels, x, weights, spec, top_weights, top_ids), rtol=0, atol=0)


def test_expert_id_out_of_range_is_refused(kernels):  # noqa: F811
    weights = _experts("fp32", 32, 32, seed=1)
    grouped = GroupedExperts.build(kernels, weights)
    x = torch.randn(2, 32)
    with pytest.raises(IndexError, match="expert id"):
        grouped.run(x, torch.tensor([[0, NUM_EXPERTS]]).expand(2, 2), torch.ones(2, 2))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_routing_matches_torch_route(kernels, norm_topk_prob, dtype):  # noqa: F811
    """route_on_kernels (softmax, top k and normalisation in cpu_moe.h) picks torch's route's
    experts in its order, with weights equal to within fp32 rounding (within bf16's, rounded)."""
    from dualpace.model.cpu_moe import route_on_kernels

    weights = _experts("fp32", 64, 32, seed=9)
    router = weights.router.to(dtype)
    spec = MoeSpec(NUM_EXPERTS, TOP_K, 32, norm_topk_prob=norm_topk_prob)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    ours_weights, ours_ids = route_on_kernels(x, router, spec, kernels)
    torch_weights, torch_ids = route(x, router, spec, lambda r, w, _: kernels.linear(r, w))
    assert torch.equal(ours_ids, torch_ids)
    assert ours_weights.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(ours_weights, torch_weights, rtol=tolerance, atol=0)


def test_native_routing_breaks_ties_toward_the_lower_expert(kernels):  # noqa: F811
    """Equal router outputs: the lower expert is chosen first, and normalised weights sum to 1."""
    from dualpace.model.cpu_moe import route_on_kernels

    spec = MoeSpec(8, 3, 16, norm_topk_prob=True)
    router = torch.zeros(8, 4)
    router[6] = 1.0  # expert 6 leads; the other seven tie
    weights, ids = route_on_kernels(torch.ones(2, 4), router, spec, kernels)
    assert ids.tolist() == [[6, 0, 1], [6, 0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_fused_moe_step_of_32_rows_in_one_region_equals_per_operation(kernels, synth_checkpoint):  # noqa: F811
    """32 decode rows through tiny-qwen3-moe's one-call step (8 experts, top 2: experts with more
    than 8 rows, whose matrices split into more chunks than the others', among task counts fixed
    before the routing) on two threads give bitwise the logits of the same call per operation (the
    grouped experts as a call of their own, counted after the routing), and the per-stage path's
    within bf16 rounding (Qwen3's q/k norms are torch's there)."""
    from dualpace.kv.storage import KVStorage
    from dualpace.model.loader import load_model
    from dualpace.model.paged_forward import PagedForward, SequenceWork, build_step_tensors
    from tests.model.test_cpu_kernels import one_region

    model = load_model(str(synth_checkpoint("tiny-qwen3-moe")), dtype="bf16", weights="bf16").model
    cfg = model.config
    work = [SequenceWork([3 + i], 2 + i % 13, [2 * i, 2 * i + 1]) for i in range(32)]
    results = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for path in ("one region", "per operation", "stages"):
            torch.manual_seed(5)
            kv = KVStorage(cfg.num_layers, 64, 8, cfg.num_kv_heads, cfg.head_dim, model.dtype)
            kv.k.normal_()
            kv.v.normal_()
            forward = PagedForward(model, kv)
            if forward._fused_decode(build_step_tensors(work, kv.block_size, kv.device)) is None:
                pytest.skip(f"the fused call takes no 32 bf16 rows of head_dim {cfg.head_dim} in {kernels.variant}")
            if path == "stages":
                forward._fused_decode = lambda step: None
            with one_region(kernels, path == "one region"):
                results.append(forward.forward(work))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], results[2], rtol=3e-2, atol=3e-2)
