"""Tiny checkpoints of each supported family, made with transformers' own model classes.

Random weights of the tiny presets' scales (linear std 0.2, embeddings 0.6, norms 1 + N(0, 0.1)),
so greedy top-1 margins are clear; the synthetic tokenizer of dualpace.model.synth.
Each family sets the features it exercises: llama3 RoPE scaling (and rope_freqs in its GGUF),
Qwen3's q/k norms, Phi-3's fused projections with partial rotation (and Phi-4-mini's LongRoPE, whose
short factors and cos/sin factor hold within its original 64-token context), Mistral's sliding window
shorter than the test's context, Gemma 3's interleaved windowed/global layers with their two
thetas, sandwich norms, GELU-tanh, scaled embeddings and query scale; the mixtures of experts their
routing variants (renormalised top-k or not, a shared expert, dense layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from dualpace.model import synth_tokenizer as stok

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, bos_token_id=stok.BOS_ID,
               eos_token_id=list(stok.EOS_IDS), pad_token_id=stok.PAD_ID)

FAMILY_CHECKPOINTS = {
    "llama3": ("LlamaConfig", dict(head_dim=16, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                  rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, rope_parameters=dict(
        rope_type="default", rope_theta=1e4, partial_rotary_factor=0.75))),
    "phi4-longrope": ("Phi3Config", dict(
        tie_word_embeddings=True, original_max_position_embeddings=64, rope_parameters=dict(
            rope_type="longrope", rope_theta=1e4, partial_rotary_factor=0.75, original_max_position_embeddings=64,
            short_factor=[1.0, 1.1, 1.3, 1.8, 2.5, 3.0], long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 8.0]))),
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=32, num_hidden_layers=4, tie_word_embeddings=True, sliding_window=12, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    "mistral-swa": ("MistralConfig", dict(head_dim=16, sliding_window=12,
                                          rope_parameters=dict(rope_type="default", rope_theta=1e4))),
    # mixtures of experts, 8 experts top-2: Mixtral (top-k weights renormalised); Qwen2-MoE (not
    # renormalised, a gated shared expert, layer 1 dense); Qwen3-MoE (q/k norms, every 2nd layer sparse)
    "mixtral": ("MixtralConfig", dict(head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                                      rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        head_dim=32, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))),
}


def write_family_checkpoint(family: str, out_dir: Path, seed: int = 0) -> Path:
    config_class, extra = FAMILY_CHECKPOINTS[family]
    config = getattr(transformers, config_class)(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's norms hold w - 1
                param.copy_((0 if config.model_type.startswith("gemma") else 1) + 0.1 * torch.randn_like(param))
            elif "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 0.6)
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    stok.build_tokenizer(config.vocab_size).save(str(out_dir / "tokenizer.json"))
    tokenizer_config = stok.tokenizer_config_dict(config.max_position_embeddings)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out_dir
