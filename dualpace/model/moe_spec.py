"""A mixture-of-experts MLP described as data, and the arithmetic of what a step reads.

Pure (no torch): the loaders, the forward (dualpace.model.moe), the profile's fingerprint and the
cost model all read it.

Routing, as transformers' Qwen2-MoE / Qwen3-MoE / Mixtral blocks do: router logits = x W_router^T,
softmax over all experts in float32, the top `num_experts_per_tok`; with `norm_topk_prob` the
chosen weights are divided by their sum (Mixtral always, Qwen3-30B-A3B by its config), without it
they stay the softmax's (Qwen2-MoE's default). Each chosen expert is a SwiGLU MLP of width
`expert_intermediate_size`; the block's output is the weighted sum. A shared expert (Qwen2-MoE)
runs for every row beside the routed ones, scaled by sigmoid(x w_shared_gate) when
`shared_expert_gated`.

Which layers are sparse: layer i is a MoE layer when i is not in `mlp_only_layers` and
(i + 1) % decoder_sparse_step == 0, the rule of transformers' Qwen*-MoE decoder layers; the others
keep a dense MLP of the model's `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpace.errors import ModelLoadError


# Hugging Face model types whose MLPs are mixtures of experts (transformers' names)
MOE_HF_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                             f"({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ModelLoadError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    @classmethod
    def from_hf_dict(cls, hf: dict) -> MoeSpec | None:
        """The MoE fields of a Hugging Face config.json (Mixtral, Qwen2-MoE, Qwen3-MoE); None for a
        dense model. Raises KeyError / ValueError on a missing or bad field."""
        model_type = hf.get("model_type")
        if model_type == "mixtral":
            return cls(int(hf["num_local_experts"]), int(hf["num_experts_per_tok"]), int(hf["intermediate_size"]),
                       norm_topk_prob=True)
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the latter
        if model_type not in MOE_HF_MODEL_TYPES or not num_experts:
            return None
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        return cls(int(num_experts), int(hf["num_experts_per_tok"]), int(hf["moe_intermediate_size"]),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)), shared_expert_intermediate_size=shared,
                   shared_expert_gated=shared > 0, decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                   mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))

    def hf_fields(self, model_type: str) -> dict:
        """The config.json fields that describe this spec for `model_type` (the reverse of from_hf_dict)."""
        if model_type == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "router_jitter_noise": 0.0}
        fields = {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                  "moe_intermediate_size": self.expert_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                  "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers)}
        if model_type == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return fields

    def is_sparse_layer(self, layer_index: int) -> bool:
        return layer_index not in self.mlp_only_layers and (layer_index + 1) % self.decoder_sparse_step == 0

    def num_sparse_layers(self, num_layers: int) -> int:
        return sum(self.is_sparse_layer(i) for i in range(num_layers))

    def expected_distinct_experts(self, num_rows: float) -> float:
        return expected_distinct_experts(self.num_experts, self.num_experts_per_tok, num_rows)


def expected_distinct_experts(num_experts: int, num_experts_per_tok: int, num_rows: float) -> float:
    """Experts a batch of `num_rows` rows selects in one layer, in expectation, when routing is
    uniform and independent between rows: E * (1 - (1 - k/E)^B) (each expert is missed by a row
    with probability 1 - k/E). k for one row, towards E for a large batch."""
    if num_rows <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - num_experts_per_tok / num_experts) ** num_rows)


@dataclass(frozen=True)
class MoeWeightBytes:
    """Bytes of a MoE model's weights a decode step reads, split by how often they are read.

    dense_bytes: read once per step whatever the batch (attention projections, dense MLP layers,
    routers, shared experts, LM head); expert_bytes: one routed expert of one sparse layer (in the
    format held); num_sparse_layers: layers whose MLP is routed."""

    num_experts: int
    num_experts_per_tok: int
    dense_bytes: int
    expert_bytes: int
    num_sparse_layers: int

    def active_bytes_per_token(self) -> int:
        """Bytes one row alone reads per step: the dense part and k experts per sparse layer."""
        return self.dense_bytes + self.num_sparse_layers * self.num_experts_per_tok * self.expert_bytes

    def step_bytes(self, num_rows: float) -> float:
        """Expected bytes a step of `num_rows` rows reads: each selected expert once, whatever the
        number of rows routed to it."""
        if num_rows <= 0:
            return 0.0
        distinct = expected_distinct_experts(self.num_experts, self.num_experts_per_tok, num_rows)
        return self.dense_bytes + self.num_sparse_layers * self.expert_bytes * distinct

    def summary(self) -> str:
        """One line for logs: what a token alone reads, and of what."""
        return (f"active per token {self.active_bytes_per_token() / 1e6:.1f} MB ({self.num_experts_per_tok} of "
                f"{self.num_experts} experts in {self.num_sparse_layers} layers, {self.expert_bytes / 1e6:.2f} MB each)")

    def total_bytes(self) -> int:
        return self.dense_bytes + self.num_sparse_layers * self.num_experts * self.expert_bytes
