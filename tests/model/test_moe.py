"""The MoE MLP (dualpace.model.moe) against transformers' own sparse blocks, on random weights in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from dualpace.errors import ModelLoadError
from dualpace.model.cpu_kernels import torch_linear
from dualpace.model.moe import MoeWeights, moe_mlp
from dualpace.model.moe_spec import MoeSpec

HIDDEN, EXPERT_FFN, SHARED_FFN, NUM_EXPERTS, TOP_K = 32, 24, 40, 8, 2


def torch_matmul(x, weight, kernel_rows):
    return torch_linear(x, weight)


def _randomise(block: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def _weights_of(block: torch.nn.Module, shared: bool) -> MoeWeights:
    experts = block.experts
    return MoeWeights(
        router=block.gate.weight.detach().clone(),
        expert_gate_up=[experts.gate_up_proj[e].detach().clone() for e in range(NUM_EXPERTS)],
        expert_down=[experts.down_proj[e].detach().clone() for e in range(NUM_EXPERTS)],
        shared_gate_up=torch.cat([block.shared_expert.gate_proj.weight, block.shared_expert.up_proj.weight]).detach()
        if shared else None,
        shared_down=block.shared_expert.down_proj.weight.detach().clone() if shared else None,
        shared_gate=block.shared_expert_gate.weight.detach().clone() if shared else None,
    )


def _block(family: str, norm_topk_prob: bool):
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K)
    if family == "mixtral":
        cfg = MixtralConfig(**common, intermediate_size=EXPERT_FFN, num_local_experts=NUM_EXPERTS)
        return MixtralSparseMoeBlock(cfg), MoeSpec(NUM_EXPERTS, TOP_K, EXPERT_FFN, norm_topk_prob=True)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, moe_intermediate_size=EXPERT_FFN, num_experts=NUM_EXPERTS,
                             norm_topk_prob=norm_topk_prob)
        return Qwen3MoeSparseMoeBlock(cfg), MoeSpec(NUM_EXPERTS, TOP_K, EXPERT_FFN, norm_topk_prob)
    cfg = Qwen2MoeConfig(**common, moe_intermediate_size=EXPERT_FFN, num_experts=NUM_EXPERTS,
                         norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=SHARED_FFN)
    return Qwen2MoeSparseMoeBlock(cfg), MoeSpec(NUM_EXPERTS, TOP_K, EXPERT_FFN, norm_topk_prob,
                                                 shared_expert_intermediate_size=SHARED_FFN, shared_expert_gated=True)


@pytest.mark.parametrize("family,norm_topk_prob", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False),
                                                   ("qwen2_moe", False), ("qwen2_moe", True)])
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_moe_mlp_matches_transformers_block(family, norm_topk_prob, num_rows):
    block, spec = _block(family, norm_topk_prob)
    _randomise(block.eval(), seed=num_rows)
    x = torch.randn(1, num_rows, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = block(x)[0]
    ours = moe_mlp(x[0], _weights_of(block, spec.shared_expert_intermediate_size > 0), spec, torch_matmul)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_normalisation_changes_the_output():
    """Both routing rules are exercised: dropping the renormalisation changes the result."""
    block, spec = _block("qwen3_moe", True)
    _randomise(block.eval(), seed=3)
    weights = _weights_of(block, shared=False)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
    unnormalised = MoeSpec(NUM_EXPERTS, TOP_K, EXPERT_FFN, norm_topk_prob=False)
    assert not torch.allclose(moe_mlp(x, weights, spec, torch_matmul), moe_mlp(x, weights, unnormalised, torch_matmul))


def test_each_selected_expert_runs_once_and_unselected_are_never_read():
    block, spec = _block("qwen3_moe", True)
    _randomise(block.eval(), seed=5)
    weights = _weights_of(block, shared=False)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    reads: list[int] = []

    def recording_matmul(rows, weight, kernel_rows):
        reads.append(id(weight))
        return torch_linear(rows, weight)

    moe_mlp(x, weights, spec, recording_matmul)
    selected = set(torch.topk(torch_linear(x, weights.router), TOP_K, dim=-1).indices.reshape(-1).tolist())
    expert_of = {id(m): e for e, m in enumerate(weights.expert_gate_up)}
    expert_of.update({id(m): e for e, m in enumerate(weights.expert_down)})
    expert_reads = [expert_of[r] for r in reads if r in expert_of]
    assert sorted(expert_reads) == sorted(2 * list(selected))  # gate/up and down once per selected expert
    assert len(selected) < NUM_EXPERTS


def test_kernel_rows_are_translated_to_each_experts_rows():
    """A row named in kernel_rows is named again, at its position among the expert's rows."""
    block, spec = _block("mixtral", True)
    _randomise(block.eval(), seed=9)
    weights = _weights_of(block, shared=False)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4))
    seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def recording_matmul(rows, weight, kernel_rows):
        seen.append((rows, kernel_rows))
        return torch_linear(rows, weight)

    moe_mlp(x, weights, spec, recording_matmul, kernel_rows=torch.tensor([4]))
    inputs = [rows[kernel_rows] for rows, kernel_rows in seen  # the router's and each gate/up's, not down's
              if kernel_rows is not None and kernel_rows.numel() and rows.shape[1] == HIDDEN]
    assert len(inputs) == 1 + TOP_K and all(torch.equal(m, x[4:5]) for m in inputs)


@pytest.mark.parametrize("num_rows", [1, 8, 32])
def test_expected_distinct_experts(num_rows):
    spec = MoeSpec(128, 8, 768, True)
    draws = torch.stack([torch.randperm(128, generator=torch.Generator().manual_seed(s))[:8]
                         for s in range(num_rows * 400)]).view(400, num_rows, 8)
    measured = sum(len(set(batch.reshape(-1).tolist())) for batch in draws) / 400
    assert spec.expected_distinct_experts(num_rows) == pytest.approx(measured, rel=0.03)
    assert spec.expected_distinct_experts(1) == pytest.approx(8)


def test_sparse_layers_follow_step_and_mlp_only_layers():
    spec = MoeSpec(4, 2, 8, True, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [spec.is_sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    with pytest.raises(ModelLoadError):
        MoeSpec(4, 5, 8, True)


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"])
def test_decode_rows_beside_a_prefill_get_what_they_get_alone(preset, synth_checkpoint):
    """Through a MoE layer on the CPU kernels, a step's decode rows (kernel_rows) get bitwise what
    they get alone, though the step's other rows send the router and the busiest experts to oneDNN."""
    from dualpace.model.loader import load_model

    model = load_model(str(synth_checkpoint(preset)), dtype="fp32").model
    if not model.kernel_capable:
        pytest.skip("the CPU kernels are off here")
    cfg = model.config
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(200, cfg.hidden_size, generator=generator)
    attention_out = torch.randn(200, cfg.num_heads * cfg.head_dim, generator=generator)
    decode_rows = torch.tensor([0, 7, 130, 199])
    layer = cfg.num_layers - 1  # sparse in both presets
    assert model.weights.layers[layer].moe is not None
    mixed = model.post_attention(layer, hidden, attention_out, kernel_rows=decode_rows)
    for i in decode_rows.tolist():
        alone = model.post_attention(layer, hidden[i:i + 1], attention_out[i:i + 1])
        assert torch.equal(mixed[i:i + 1], alone), f"decode row {i}"


def test_host_memory_report_states_active_bytes_per_token(synth_checkpoint):
    from dualpace.model.loader import describe_weights, load_model, moe_weight_bytes, weights_num_bytes

    loaded = load_model(str(synth_checkpoint("tiny-mixtral")), dtype="fp32")
    cfg, weights = loaded.config, loaded.model.weights
    moe = moe_weight_bytes(weights, cfg)
    hidden, ffn = cfg.hidden_size, cfg.moe.expert_intermediate_size
    assert moe.expert_bytes == 3 * hidden * ffn * 4 and moe.num_sparse_layers == cfg.num_layers
    embedding_bytes = cfg.vocab_size * hidden * 4  # untied: a step reads a row of it per token
    assert moe.total_bytes() == weights_num_bytes(weights) - embedding_bytes
    assert moe.active_bytes_per_token() == moe.dense_bytes + cfg.num_layers * 2 * moe.expert_bytes
    line = describe_weights(weights, torch.device("cpu"), torch.float32, cfg)
    assert f"active per token {moe.active_bytes_per_token() / 1e6:.1f} MB (2 of 8 experts in 2 layers" in line
    dense = load_model(str(synth_checkpoint("tiny-llama")), dtype="fp32")
    assert moe_weight_bytes(dense.model.weights, dense.config) is None
