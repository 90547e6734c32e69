"""ModelConfig: one normalised description of a model, from HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_ROPE_THETA = 10000.0


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

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Rebuild a ModelConfig from the output of `to_dict`."""
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str) -> ModelConfig:
        """Build a ModelConfig from a Hugging Face config.json dict."""
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope_theta, rope_scaling = _hf_rope(d)
        return cls(
            architecture=d["model_type"],
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
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
        )

    @classmethod
    def from_gguf_metadata(cls, reader, name: str) -> ModelConfig:
        """Build a ModelConfig from a `gguf.GGUFReader`'s metadata and tensor list."""
        meta = GGUFMetadata(reader)
        arch = meta.get("general.architecture")
        num_heads = int(meta.arch("attention.head_count"))
        hidden = int(meta.arch("embedding_length"))
        tensor_names = {t.name for t in reader.tensors}
        return cls(
            architecture=arch,
            vocab_size=_gguf_vocab_size(reader, meta),
            hidden_size=hidden,
            intermediate_size=int(meta.arch("feed_forward_length")),
            num_layers=int(meta.arch("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.arch("attention.head_count_kv", num_heads)),
            head_dim=int(meta.arch("attention.key_length", hidden // num_heads)),
            rms_norm_eps=float(meta.arch("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.arch("rope.freq_base", DEFAULT_ROPE_THETA)),
            rope_scaling=_gguf_rope_scaling(meta),
            max_position_embeddings=int(meta.arch("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=_gguf_eos_ids(meta),
            name=name,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        )


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata."""

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


def _hf_rope(d: dict[str, Any]) -> tuple[float, dict | None]:
    params = dict(d.get("rope_parameters") or {})
    theta = d.get("rope_theta", params.get("rope_theta", DEFAULT_ROPE_THETA))
    scaling = dict(d.get("rope_scaling") or params)
    return float(theta), _normalise_rope_scaling(scaling)


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
    return len(meta.get("tokenizer.ggml.tokens"))


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
