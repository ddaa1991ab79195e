"""The model description shared by loaders, every forward path and synthetic checkpoints.

A family (Hugging Face `model_type`, GGUF `general.architecture`) is one row of FAMILIES: how its
checkpoints name and lay out tensors and which features it always has. A model is a ModelConfig:
its shapes plus the features this checkpoint sets (q/k norms, sliding window, RoPE variant).
Adding a family is a FAMILIES entry plus its tests; a feature the forward paths do not compute is
refused at load, by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dualpace.errors import ModelLoadError
from dualpace.model.moe_spec import MoeSpec


@dataclass(frozen=True)
class Family:
    """How one architecture's checkpoints are written, and what it always has."""

    name: str  # Hugging Face model_type and GGUF general.architecture
    hf_class: str  # transformers' causal-LM class (config.json "architectures")
    qkv_bias: bool = False  # biases on q/k/v (not on o)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    fused_hf_projections: bool = False  # one qkv_proj and one gate_up_proj in the HF checkpoint (Phi-3)
    gguf_permuted_qk: bool = False  # llama.cpp's converter interleaves the rotary halves of Q/K rows
    has_sliding_window: bool = False  # config.json's sliding_window applies (to every layer, or per layer_types)
    # Gemma: sandwich norms (after attention and after the MLP too), RMSNorm weights stored as
    # w - 1 (HF; a GGUF stores w), GELU-tanh gates, embeddings scaled by sqrt(hidden)
    gemma: bool = False
    gguf_arch: str = ""  # GGUF general.architecture where it differs from name

    @property
    def gguf_name(self) -> str:
        return self.gguf_arch or self.name


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", "LlamaForCausalLM", gguf_permuted_qk=True),
        # written to GGUF as llama, as llama.cpp does (its window kept in the file's sliding_window key)
        Family("mistral", "MistralForCausalLM", gguf_permuted_qk=True, has_sliding_window=True, gguf_arch="llama"),
        Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
        Family("phi3", "Phi3ForCausalLM", fused_hf_projections=True, has_sliding_window=True),
        Family("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, has_sliding_window=True, gemma=True,
               gguf_arch="gemma3"),
        # mixtures of experts (ModelConfig.moe): llama.cpp writes Mixtral as "llama" with an expert count
        Family("mixtral", "MixtralForCausalLM", gguf_permuted_qk=True, has_sliding_window=True, gguf_arch="llama"),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, gguf_arch="qwen2moe"),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, gguf_arch="qwen3moe"),
    )
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# the first family of each GGUF architecture: "llama" is Llama (a Mixtral file says so by its expert count)
FAMILY_BY_GGUF_ARCH: dict[str, Family] = {}
for _family in FAMILIES.values():
    FAMILY_BY_GGUF_ARCH.setdefault(_family.gguf_name, _family)


def unsupported(what: str) -> ModelLoadError:
    """The one-line refusal of an architecture or a feature, listing what is supported."""
    return ModelLoadError(f"unsupported {what}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)} "
                          "(README.md, Supported models)")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape, hyper-parameters and features of one decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # A GGUF's rope_freqs tensor: each rotation frequency is divided by its factor (llama3 scaling
    # as llama.cpp's converter stores it), [rotary_dim / 2]
    rope_freq_factors: tuple[float, ...] | None = None
    rotary_dim: int | None = None  # dims of each head that RoPE rotates (the first ones); None: all
    rope_attention_factor: float = 1.0  # cos and sin are multiplied by it (LongRoPE)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # tokens each query sees (itself included) in a windowed layer; None: all
    # which layers the window applies to (Gemma 3's interleaved local/global layers); None: every layer
    window_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = None  # RoPE theta of windowed layers where it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma); None: head_dim
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeSpec | None = None  # mixture-of-experts MLPs (dualpace.model.moe_spec); None: dense

    def __post_init__(self):
        if self.architecture not in FAMILIES:
            raise unsupported(f"architecture {self.architecture!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ModelLoadError(f"rotary dims {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.num_rotary_dims // 2:
            raise ModelLoadError(f"rope_freqs has {len(self.rope_freq_factors)} factors, expected "
                                 f"{self.num_rotary_dims // 2}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.window_layers is not None and len(self.window_layers) != self.num_layers:
            raise ModelLoadError(f"layer_types names {len(self.window_layers)} layers, the model has {self.num_layers}")

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def num_rotary_dims(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def embedding_scale(self) -> float | None:
        """What embeddings are multiplied by (in the embedding's dtype, as transformers does); None: 1."""
        return self.hidden_size**0.5 if self.family.gemma else None

    def layer_window(self, layer_index: int) -> int | None:
        """How many tokens a query of `layer_index` sees (itself included); None: the whole context."""
        if self.window_layers is not None and not self.window_layers[layer_index]:
            return None
        return self.sliding_window

    @property
    def window_of_every_layer(self) -> int | None:
        """The sliding window when every layer has it (Mistral, Phi-3); else None (some layer is global)."""
        return self.sliding_window if self.window_layers is None else None

    @property
    def mixes_window_and_global_layers(self) -> bool:
        """Whether some layers slide and others see the whole context (Gemma 3): the engines then give
        the sliding layers a KV pool of their own (dualpace.engine.core.kv_pool_sizes)."""
        return self.sliding_window is not None and self.window_layers is not None

    def layer_rope_theta(self, layer_index: int) -> float:
        if self.local_rope_theta is not None and self.layer_window(layer_index) is not None:
            return self.local_rope_theta
        return self.rope_theta

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary."""
        model_type = hf.get("model_type", "")
        if model_type not in FAMILIES:
            raise unsupported(f"architecture {model_type!r} in config.json")
        family = FAMILIES[model_type]
        _refuse_unsupported_hf_features(hf, family)
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            head_dim = int(hf.get("head_dim") or hidden // num_heads)
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope = _rope_from_hf(hf, model_type, head_dim)
            # LongRoPE's short factors hold up to the original context; the served context stops there
            max_positions = rope.pop("context_limit", None) or int(hf.get("max_position_embeddings", 4096))
            return cls(
                architecture=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=family.qkv_bias,
                qk_norm=family.qk_norm,
                query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]) if family.gemma else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                **rope,
                **_windows_from_hf(hf, family, max_positions),
                moe=MoeSpec.from_hf_dict(hf),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value: {exc}") from exc

    def to_hf_dict(self) -> dict:
        """The Hugging Face config.json dictionary for this configuration."""
        if self.rope_freq_factors is not None:
            raise unsupported("export: rope frequency factors (a GGUF's rope_freqs, LongRoPE) have no plain "
                              "Hugging Face config form")
        hf = {
            "architectures": [self.family.hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "gelu_pytorch_tanh" if self.family.gemma else "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": None,  # Phi-3's default (32000) lies outside a small vocabulary
        }
        if not self.family.qkv_bias:
            hf["attention_bias"] = False  # Qwen2 has q/k/v biases by definition; Llama's flag would add o_proj too
        if self.family.has_sliding_window:
            hf["sliding_window"] = self.sliding_window
        if self.rotary_dim is not None:
            hf["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        if self.family.gemma:
            hf["hidden_activation"] = hf["hidden_act"]
            scalar = self.query_pre_attn_scalar or self.head_dim
            hf["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar  # transformers: an int
            hf["rope_local_base_freq"] = self.local_rope_theta or self.rope_theta
            hf["layer_types"] = ["sliding_attention" if self.layer_window(i) else "full_attention"
                                 for i in range(self.num_layers)]
        if self.moe is not None:
            hf.update(self.moe.hf_fields(self.architecture))
        if self.rope_scaling is not None:
            hf["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
            }
        return hf


def _refuse_unsupported_hf_features(hf: dict, family: Family) -> None:
    name = family.name
    if not family.qkv_bias and hf.get("attention_bias"):
        raise unsupported(f"feature of {name}: attention_bias (biases on the q/k/v/o projections)")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if activation != ("gelu_pytorch_tanh" if family.gemma else "silu"):
        raise unsupported(f"feature of {name}: hidden_act {activation!r} (SiLU-gated MLPs are, GELU-tanh for Gemma)")
    for feature in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(feature):
            raise unsupported(f"feature of {name}: {feature}")
    if name in ("qwen3", "qwen2_moe", "qwen3_moe") and hf.get("use_sliding_window"):
        raise unsupported(f"feature of {name}: use_sliding_window")


def _rope_type(params: dict) -> str | None:
    return params.get("rope_type", params.get("type"))


def _rope_from_hf(hf: dict, model_type: str, head_dim: int) -> dict:
    """rope_theta, rope_scaling, local_rope_theta and rotary_dim from a config.json (either the
    old top-level keys or transformers 5's rope_parameters, per layer type for Gemma 3); for
    LongRoPE the short factors, the cos/sin factor and the original context (context_limit)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    local_rope = None
    if "full_attention" in rope:  # per layer type (Gemma 3)
        rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
    theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    partial = float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    scaling = None
    if _rope_type(rope) == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    longrope = {}
    if _rope_type(rope) == "longrope":
        original = int(rope.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
        factor = float(rope.get("factor") or int(hf["max_position_embeddings"]) / original)
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        longrope = dict(rope_freq_factors=tuple(float(f) for f in rope["short_factor"]),
                        rope_attention_factor=float(attention_factor), context_limit=original)
    for params in ([] if scaling or longrope else [rope]) + ([local_rope] if local_rope is not None else []):
        if _rope_type(params) not in (None, "default"):
            raise unsupported(f"feature of {model_type}: rope scaling {_rope_type(params)!r} (plain, llama3 and "
                              "longrope are)")
    local_theta = None
    if local_rope is not None or "rope_local_base_freq" in hf:
        local_theta = float(hf.get("rope_local_base_freq", (local_rope or {}).get("rope_theta", 10000.0)))
    return dict(rope_theta=theta, rope_scaling=scaling, rotary_dim=None if partial == 1.0 else int(head_dim * partial),
                local_rope_theta=local_theta if local_theta != theta else None, **longrope)


def _windows_from_hf(hf: dict, family: Family, max_positions: int) -> dict:
    """sliding_window and window_layers: a window as long as the context is no window; layer_types
    (Gemma 3: every sliding_window_pattern-th layer global) say which layers have it."""
    window = hf.get("sliding_window") if family.has_sliding_window else None
    if window is None or int(window) >= max_positions:
        return dict(sliding_window=None, window_layers=None)
    layer_types = hf.get("layer_types")
    if family.gemma and layer_types is None:
        pattern = int(hf.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(int(hf["num_hidden_layers"]))]
    windowed = tuple(t == "sliding_attention" for t in layer_types or [])
    if layer_types is not None and not any(windowed):
        return dict(sliding_window=None, window_layers=None)
    return dict(sliding_window=int(window), window_layers=None if all(windowed) else windowed)
