"""Model configuration shared by loaders, the model core and synthetic checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpace.errors import ModelLoadError
from dualpace.model.moe_spec import MoeSpec

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
_QKV_BIAS_ARCHITECTURES = ("qwen2", "qwen2_moe")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style RoPE frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder."""

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
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeSpec | None = None  # mixture-of-experts MLPs (dualpace.model.moe_spec); None: dense

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dictionary."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {model_type!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type not in _QKV_BIAS_ARCHITECTURES and hf.get("attention_bias"):
            raise ModelLoadError(
                f"{model_type} with attention_bias (biases on the q/k/v/o projections) is not supported"
            )
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
            rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
            scaling = None
            if rope.get("rope_type", rope.get("type")) == "llama3":
                scaling = RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                )
            elif rope.get("rope_type", rope.get("type")) not in (None, "default"):
                raise ModelLoadError(f"unsupported rope scaling {rope!r}")
            return cls(
                architecture=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=model_type in _QKV_BIAS_ARCHITECTURES,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                moe=MoeSpec.from_hf_dict(hf),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value: {exc}") from exc

    def to_hf_dict(self) -> dict:
        """The Hugging Face config.json dictionary for this configuration."""
        hf = {
            "architectures": [_HF_CLASSES[self.architecture]],
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
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.architecture == "llama":
            hf["attention_bias"] = False  # Qwen2 has q/k/v biases by definition; Llama's flag would add o_proj too
        if self.architecture in ("mistral", "mixtral"):
            hf["sliding_window"] = None
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
