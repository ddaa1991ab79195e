"""Tiny mixture-of-experts checkpoints made with transformers' own classes, for parity tests.

Weights are drawn with std 0.2 (embeddings and LM head 0.6, norms 1 + N(0, 0.1)) so that greedy
top-1 margins are clear (ARCHITECTURE.md §9); the tokenizer is the synthetic one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from dualpace.model import synth_tokenizer as stok

VOCAB = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=1024, num_experts_per_tok=2, bos_token_id=stok.BOS_ID,
               eos_token_id=list(stok.EOS_IDS), tie_word_embeddings=False)
# family -> (transformers class, its config); Qwen2-MoE with a gated shared expert, unnormalised
# top-k weights and a dense layer 1 (mlp_only_layers)
FAMILIES = {
    "mixtral": (MixtralForCausalLM, lambda: MixtralConfig(**_COMMON, intermediate_size=96, num_local_experts=8)),
    "qwen2_moe": (Qwen2MoeForCausalLM, lambda: Qwen2MoeConfig(
        **_COMMON, intermediate_size=128, moe_intermediate_size=64, num_experts=8, shared_expert_intermediate_size=96,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])),
}


def write_moe_checkpoint(family: str, folder: Path, seed: int = 1) -> Path:
    model_class, make_config = FAMILIES[family]
    model = model_class(make_config()).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                std = 0.6 if "embed_tokens" in name or "lm_head" in name else 0.2
                p.copy_(std * torch.randn(p.shape, generator=generator))
    model.save_pretrained(folder)
    stok.build_tokenizer(VOCAB).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(stok.tokenizer_config_dict(1024)))
    return folder


def load_reference(family: str, folder: Path):
    """transformers' model of the checkpoint, fp32, in eval mode."""
    return FAMILIES[family][0].from_pretrained(folder, dtype=torch.float32).eval()
