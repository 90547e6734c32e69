"""ModelConfig: one normalised description of a model, from HF config.json or GGUF metadata.

Families: llama, qwen2, qwen3, mistral, gemma3, deepseek_v2, deepseek_v3. The common fields
describe a decoder of `num_layers` blocks; the optional fields (all defaulted, so a Llama
config and older cached configs need none of them) describe what the other families add:

- attention_bias / attention_out_bias: bias on q/k/v and on o_proj (Qwen2: True / False).
- qk_norm: RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3).
- sliding_window, layer_types: a window of W keys (a query at position p sees keys p-W+1..p,
  as in transformers' masks). `layer_types` is the HF per-layer list ("sliding_attention" /
  "full_attention"); None means every layer has the same kind: sliding when `sliding_window`
  is set, else full. `layer_kinds()` gives the normalised "sliding" / "full" per layer.
- rope_theta / rope_scaling: RoPE of full-attention layers; rope_local_theta /
  rope_local_scaling: RoPE of sliding layers when they differ (Gemma 3); see `layer_rope()`.
- query_pre_attn_scalar: attention scores are scaled by query_pre_attn_scalar**-0.5 instead of
  head_dim**-0.5 (Gemma 3); `attention_scale()` gives the factor for every family.
- attn_logit_softcapping / final_logit_softcapping: cap*tanh(x/cap) on attention scores /
  final logits when set.
- hidden_act: the MLP activation (HF name: "silu", "gelu_pytorch_tanh").
- embedding_scale: multiply token embeddings by this (Gemma: sqrt(hidden_size)).
- norm_offset: RMSNorm multiplies by (norm_offset + weight) (Gemma: 1.0; stored weights follow
  the HF convention, i.e. without the offset).
- sandwich_norms: extra post-attention and pre/post-feedforward norms (Gemma 3 block layout).
- mla: multi-head latent attention dims (DeepSeek-V2/V3), see `MLAConfig`; None otherwise.
  For MLA models `head_dim` is the RoPE'd part of a head (qk_rope_head_dim), as in transformers.
- moe: mixture-of-experts routing (DeepSeek-V2/V3), see `MoEConfig`; `mlp_kinds()` says which
  layers are MoE. `intermediate_size` stays the size of the dense MLP layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

DEFAULT_ROPE_THETA = 10000.0
SLIDING, FULL = "sliding", "full"
HF_LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": FULL}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "deepseek_v2", "deepseek_v3")
# HF model_type -> kvserve architecture (identity for the rest).
ARCHITECTURE_ALIASES = {"gemma3_text": "gemma3"}

# every N-th layer full, the rest sliding: each family's interleave when a config or GGUF names none
# (llama.cpp's for GGUFs without attention.sliding_window_pattern)
SWA_PATTERNS = {"gemma3": 6, "gemma2": 2}
# transformers 5 Gemma3TextConfig defaults: Google's hub configs list only what differs from them.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": SWA_PATTERNS["gemma3"],
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}
GEMMA3_GGUF_LOCAL_THETA = 10000.0


@dataclass
class MLAConfig:
    """Multi-head latent attention dims (DeepSeek-V2/V3).

    Queries: q_lora_rank None -> q_proj straight from hidden; else q_a_proj -> RMSNorm ->
    q_b_proj. Keys/values: kv_a_proj_with_mqa gives a latent of kv_lora_rank (RMSNorm'd, then
    kv_b_proj expands it per head into qk_nope_head_dim + v_head_dim) plus one shared RoPE key
    of qk_rope_head_dim. The cache holds latent + rope key per token and layer.
    rope_interleave: the RoPE pairs are adjacent (x0,x1),(x2,x3)... as in DeepSeek's own code
    (transformers: DeepseekV2 always, DeepseekV3 when config.rope_interleave).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: the no-RoPE part plus the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements cached per token and layer: the latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class MoEConfig:
    """Mixture-of-experts routing (DeepSeek-V2/V3 names and meanings).

    A layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0; it runs
    n_shared_experts always (one MLP of n_shared_experts * moe_intermediate_size) plus the
    num_experts_per_tok best of n_routed_experts (each moe_intermediate_size wide).
    scoring_func "softmax" (V2) or "sigmoid" (V3, with a per-expert e_score_correction_bias
    used only to choose); topk_method "greedy", "group_limited_greedy" (V2) or "noaux_tc"
    (V3: groups ranked by the sum of their top-2 corrected scores); n_group / topk_group limit
    the choice to the best topk_group of n_group expert groups; norm_topk_prob renormalises
    the chosen weights to sum 1; routed_scaling_factor multiplies them.
    """

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"


@dataclass
class ModelConfig:
    """Architecture hyperparameters kvserve needs to build and size a model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    name: str
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_out_bias: bool | None = None  # None: same as attention_bias
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    rope_local_scaling: dict | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    embedding_scale: float | None = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

    def __post_init__(self):
        if self.attention_out_bias is None:
            self.attention_out_bias = self.attention_bias
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - set(HF_LAYER_TYPES))
            if unknown:
                raise ValueError(f"unsupported layer types {unknown}; supported: {sorted(HF_LAYER_TYPES)}")

    def layer_kinds(self) -> list[str]:
        """Per layer, "sliding" where a sliding window applies, else "full"."""
        if not self.sliding_window:
            return [FULL] * self.num_layers
        if self.layer_types is None:
            return [SLIDING] * self.num_layers
        return [HF_LAYER_TYPES[t] for t in self.layer_types]

    def layer_rope(self, layer: int) -> tuple[float, dict | None]:
        """(rope theta, rope scaling) of `layer`: the local pair on sliding layers when set."""
        if self.rope_local_theta is not None and self.layer_kinds()[layer] == SLIDING:
            return self.rope_local_theta, self.rope_local_scaling
        return self.rope_theta, self.rope_scaling

    def attention_scale(self) -> float:
        """Factor applied to q·k before softmax."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        if self.mla is None:
            return self.head_dim**-0.5
        scale = self.mla.qk_head_dim**-0.5
        scaling = self.rope_scaling or {}
        mscale_all_dim = scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:  # DeepSeek's yarn: softmax scale grows with the context extension
            factor = float(scaling["factor"])
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= mscale * mscale
        return scale

    def mlp_kinds(self) -> list[str]:
        """Per layer, "moe" for a mixture-of-experts MLP, else "dense"."""
        moe = self.moe
        if moe is None:
            return ["dense"] * self.num_layers
        return [
            "moe" if i >= moe.first_k_dense_replace and i % moe.moe_layer_freq == 0 else "dense"
            for i in range(self.num_layers)
        ]

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Rebuild a ModelConfig from the output of `to_dict`."""
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str) -> ModelConfig:
        """Build a ModelConfig from a Hugging Face config.json dict (any supported family)."""
        d = _hf_text_config(d)
        arch = normalise_architecture(d["model_type"])
        if arch == "gemma3":
            d = _with_gemma3_defaults(d)
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope_theta, rope_scaling, local_theta, local_scaling = _hf_rope_by_layer_type(d)
        attention_bias = bool(d.get("attention_bias", False))
        fields = dict(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
            name=name,
            attention_bias=attention_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=str(d.get("hidden_act") or d.get("hidden_activation") or "silu"),
        )
        fields.update(_FAMILY_FIELDS.get(arch, _no_family_fields)(d, local_theta, local_scaling))
        return cls(**fields)

    @classmethod
    def from_gguf_metadata(cls, reader, name: str) -> ModelConfig:
        """Build a ModelConfig from a `gguf.GGUFReader`'s metadata and tensor list."""
        meta = GGUFMetadata(reader)
        tensor_names = {t.name for t in reader.tensors}
        config = cls(
            architecture=meta.get("general.architecture"),
            **gguf_attention_fields(reader, meta),
            intermediate_size=meta.count("feed_forward_length"),
            rms_norm_eps=float(meta.arch("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.arch("rope.freq_base", DEFAULT_ROPE_THETA)),
            rope_scaling=_gguf_rope_scaling(meta),
            max_position_embeddings=meta.count("context_length"),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=_gguf_eos_ids(meta),
            name=name,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        )
        family_fields = _GGUF_FAMILY_FIELDS.get(config.architecture)
        if family_fields is not None:
            config = dataclasses.replace(config, **family_fields(config, meta))
        return config


def normalise_architecture(model_type: str) -> str:
    """kvserve's architecture name for an HF model_type ("gemma3_text" -> "gemma3")."""
    return ARCHITECTURE_ALIASES.get(model_type, model_type)


def _hf_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a multimodal config's `text_config` (Gemma3ForConditionalGeneration)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        return d
    text = dict(text)
    text.setdefault("model_type", f"{d.get('model_type', 'gemma3')}_text")
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if text.get(key) is None and d.get(key) is not None:
            text[key] = d[key]
    return text


def _with_gemma3_defaults(d: dict[str, Any]) -> dict[str, Any]:
    """Fill what a Gemma 3 config leaves out (or nulls where null means "default")."""
    nullable = {"sliding_window", "final_logit_softcapping", "attn_logit_softcapping", "rope_scaling"}
    given = {k: v for k, v in d.items() if v is not None or k in nullable}
    defaults = dict(GEMMA3_TEXT_DEFAULTS)
    if "rope_parameters" in given:  # transformers 5: thetas live there
        defaults.pop("rope_theta")
    return {**defaults, **given}


def _no_family_fields(d: dict[str, Any], local_theta, local_scaling) -> dict[str, Any]:
    return {}


def _mistral_fields(d: dict[str, Any], local_theta, local_scaling) -> dict[str, Any]:
    window = d.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


def _qwen2_fields(d: dict[str, Any], local_theta, local_scaling) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases and no o_proj bias; config.json does not say so.
    return {"attention_bias": True, "attention_out_bias": False, **_qwen_window(d)}


def _qwen3_fields(d: dict[str, Any], local_theta, local_scaling) -> dict[str, Any]:
    return {"qk_norm": True, **_qwen_window(d)}


def _qwen_window(d: dict[str, Any]) -> dict[str, Any]:
    """Qwen's window applies only with use_sliding_window, on layers >= max_window_layers."""
    window = d.get("sliding_window")
    if not (d.get("use_sliding_window") and window):
        return {}
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = int(d.get("max_window_layers", num_layers))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return {"sliding_window": int(window), "layer_types": list(layer_types)}


def _gemma3_fields(d: dict[str, Any], local_theta, local_scaling) -> dict[str, Any]:
    num_layers = int(d["num_hidden_layers"])
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or SWA_PATTERNS["gemma3"])
        layer_types = gemma3_layer_types(num_layers, pattern)
    window = d.get("sliding_window")
    if local_theta is None:
        local_theta = float(d.get("rope_local_base_freq", GEMMA3_TEXT_DEFAULTS["rope_local_base_freq"]))
    return {
        "qk_norm": True,
        "sliding_window": int(window) if window else None,
        "layer_types": list(layer_types),
        "rope_local_theta": local_theta,
        "rope_local_scaling": local_scaling,
        "query_pre_attn_scalar": float(d["query_pre_attn_scalar"]),
        "attn_logit_softcapping": _optional_float(d.get("attn_logit_softcapping")),
        "final_logit_softcapping": _optional_float(d.get("final_logit_softcapping")),
        "hidden_act": str(d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"),
        "embedding_scale": float(d["hidden_size"]) ** 0.5,
        "norm_offset": 1.0,
        "sandwich_norms": True,
    }


def gemma3_layer_types(num_layers: int, pattern: int) -> list[str]:
    """Gemma 3's interleave: every `pattern`-th layer is full attention, the rest sliding."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _deepseek_fields(d: dict[str, Any], local_theta, local_scaling) -> dict[str, Any]:
    v3 = d["model_type"] == "deepseek_v3"
    q_lora_rank = d.get("q_lora_rank")
    mla = MLAConfig(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
    )
    fields: dict[str, Any] = {"mla": mla, "head_dim": mla.qk_rope_head_dim}
    if d.get("n_routed_experts"):
        fields["moe"] = MoEConfig(
            n_routed_experts=int(d["n_routed_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            topk_method=str(d.get("topk_method") or ("noaux_tc" if v3 else "greedy")),
            n_group=int(d["n_group"]) if d.get("n_group") else None,
            topk_group=int(d["topk_group"]) if d.get("topk_group") else None,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            scoring_func=str(d.get("scoring_func") or ("sigmoid" if v3 else "softmax")),
        )
    return fields


_FAMILY_FIELDS = {
    "mistral": _mistral_fields,
    "qwen2": _qwen2_fields,
    "qwen3": _qwen3_fields,
    "gemma3": _gemma3_fields,
    "deepseek_v2": _deepseek_fields,
    "deepseek_v3": _deepseek_fields,
}


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata (read lazily, key by key)."""

    _MISSING = object()

    def __init__(self, reader):
        self.fields = reader.fields
        arch_field = self.fields.get("general.architecture")
        self.prefix = arch_field.contents() if arch_field is not None else None

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Return the value stored under `key`, or `default` (KeyError when none is given)."""
        field = self.fields.get(key)
        if field is not None:
            return field.contents()
        if default is self._MISSING:
            raise KeyError(f"GGUF metadata has no key {key!r}; the file may be incomplete or of an unsupported architecture")
        return default

    def arch(self, suffix: str, default: Any = _MISSING) -> Any:
        """Return the architecture-scoped value `<general.architecture>.<suffix>`."""
        return self.get(f"{self.prefix}.{suffix}", default)

    def count(self, suffix: str, default: Any = _MISSING) -> int:
        """An architecture-scoped count; a per-layer array gives its largest entry (the one that sizes memory)."""
        value = self.arch(suffix, default)
        return int(max(value)) if isinstance(value, (list, tuple)) else int(value)

    def length(self, key: str) -> int:
        """Number of entries of the array under `key`, without decoding them (a vocabulary)."""
        field = self.fields.get(key)
        if field is None:
            raise KeyError(f"GGUF metadata has no key {key!r}; the file may be incomplete or of an unsupported architecture")
        return len(field.data)


def gguf_attention_fields(reader, meta: GGUFMetadata) -> dict[str, Any]:
    """The decoder's attention shape as ModelConfig fields, for any GGUF architecture."""
    num_heads = meta.count("attention.head_count")
    hidden = meta.count("embedding_length")
    return {
        "vocab_size": _gguf_vocab_size(reader, meta),
        "hidden_size": hidden,
        "num_layers": meta.count("block_count"),
        "num_heads": num_heads,
        "num_kv_heads": meta.count("attention.head_count_kv", num_heads),
        "head_dim": meta.count("attention.key_length", hidden // num_heads),
    }


def gguf_window_fields(meta: GGUFMetadata, num_layers: int) -> dict[str, Any]:
    """sliding_window (None without one) and layer_types, as llama.cpp reads them."""
    window = meta.arch("attention.sliding_window", None)
    pattern = meta.arch("attention.sliding_window_pattern", None)
    return {
        "sliding_window": int(window) if window else None,
        "layer_types": gguf_layer_types(meta.prefix, num_layers, pattern),
    }


def _gemma3_gguf_fields(config: ModelConfig, meta: GGUFMetadata) -> dict[str, Any]:
    """Gemma 3 facts a GGUF leaves implicit, filled in the way llama.cpp does."""
    scale = meta.arch("attention.scale", None)
    if scale:
        scalar = 1.0 / float(scale) ** 2
    elif config.num_layers == 62:  # llama.cpp: Gemma-3-27B scales by hidden/heads, not head_dim
        scalar = float(config.hidden_size // config.num_heads)
    else:
        scalar = float(config.head_dim)
    return {
        **gguf_window_fields(meta, config.num_layers),
        "rope_local_theta": float(meta.arch("rope.freq_base_swa", GEMMA3_GGUF_LOCAL_THETA)),
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": _optional_float(meta.arch("attn_logit_softcapping", None)),
        "final_logit_softcapping": _optional_float(meta.arch("final_logit_softcapping", None)),
        "hidden_act": "gelu_pytorch_tanh",
        "embedding_scale": float(config.hidden_size) ** 0.5,
        "norm_offset": 1.0,
        "sandwich_norms": True,
    }


def gguf_layer_types(arch: str, num_layers: int, pattern) -> list[str]:
    """Each layer's attention from a GGUF's sliding_window_pattern: one bool per layer (True =
    sliding, newer files), every N-th layer full, or absent (llama.cpp's interleave for the
    architecture; every layer sliding where it has none)."""
    if isinstance(pattern, list):
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    pattern = pattern or SWA_PATTERNS.get(arch)
    if not pattern:
        return ["sliding_attention"] * num_layers
    return gemma3_layer_types(num_layers, int(pattern))


# GGUF architecture -> the reader of what its files leave implicit (the engine's families only).
_GGUF_FAMILY_FIELDS = {"gemma3": _gemma3_gguf_fields}


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict | None]:
    params = dict(d.get("rope_parameters") or {})
    theta = d.get("rope_theta", params.get("rope_theta", DEFAULT_ROPE_THETA))
    scaling = dict(d.get("rope_scaling") or params)
    return float(theta), _normalise_rope_scaling(scaling)


def _hf_rope_by_layer_type(d: dict[str, Any]) -> tuple[float, dict | None, float | None, dict | None]:
    """(theta, scaling) of full layers and, when the config splits them, of sliding layers.

    transformers 5 writes `rope_parameters` keyed by layer type for Gemma 3; older configs write
    rope_theta / rope_scaling (full layers) and rope_local_base_freq (sliding layers).
    """
    params = d.get("rope_parameters") or {}
    if not any(kind in params for kind in HF_LAYER_TYPES):
        theta, scaling = _hf_rope(d)
        return theta, scaling, None, None
    full = _hf_rope({"rope_parameters": params.get("full_attention") or {}})
    local = params.get("sliding_attention")
    if local is None:
        return (*full, None, None)
    return (*full, *_hf_rope({"rope_parameters": local}))


def _normalise_rope_scaling(scaling: dict) -> dict | None:
    scaling.pop("rope_theta", None)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return None
    return scaling


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _gguf_vocab_size(reader, meta: GGUFMetadata) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    vocab = meta.arch("vocab_size", None)
    if vocab is not None:
        return int(vocab)
    return meta.length("tokenizer.ggml.tokens")


def _gguf_eos_ids(meta: GGUFMetadata) -> list[int]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [meta.get(k, None) for k in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _gguf_rope_scaling(meta: GGUFMetadata) -> dict | None:
    kind = meta.arch("rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    scaling = {"rope_type": kind, "factor": float(meta.arch("rope.scaling.factor", 1.0))}
    original = meta.arch("rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling
