"""Pure KV-cache sizing formulas, shared by the engine's pool and `kvserve plan`.

Everything here is arithmetic on shapes: no torch, no I/O, nothing from engine/ or model/.
Units are bytes, tokens and seconds unless a name says otherwise.

Vocabulary:
- a *KV vector* is what one token stores per layer per stored head: a key or a value head of
  `head_dim` elements (MHA/GQA/MQA: 2 * num_kv_heads vectors per token per layer), or, for MLA,
  the single latent of `kv_lora_rank + rope_dim` elements (no factor 2, no head count);
- a *local* layer attends over the last `sliding_window` tokens only, so its cache stops
  growing there; a *global* layer keeps every token.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

# --- the engine pool's block count -------------------------------------------------------------


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """How many whole blocks of `block_size` tokens fit in `budget_bytes`."""
    return max(0, budget_bytes // (block_size * bytes_per_token))


# --- KV storage formats -----------------------------------------------------------------------


@dataclass(frozen=True)
class KVFormat:
    """How one KV element is stored: payload bits plus per-group scale/zero metadata.

    `group_size` elements share `scale_bytes` of metadata; 0 means one group per KV vector
    (per token, per head: `head_dim` elements, or the whole MLA latent). `residual_tokens` most
    recent tokens of each sequence stay in full precision at `residual_bytes` per element.
    """

    name: str
    bits: float
    scale_bytes: float = 0.0
    group_size: int = 0
    residual_tokens: int = 0
    residual_bytes: float = 2.0
    note: str = ""


KIVI_GROUP = 32          # KIVI: tokens per key group, channels per value group (kv/formats.py reads it)
# The engine keeps a sequence's still-filling block in full precision (kv/formats.py): one residual
# row of block_size tokens per running sequence, block_size 32 for KIVI (KIVI's paper uses R = 128).
KIVI_RESIDUAL = 32

KV_FORMATS: dict[str, KVFormat] = {
    "fp32": KVFormat("fp32", 32, note="native float32"),
    "bf16": KVFormat("bf16", 16, note="native bfloat16"),
    "fp16": KVFormat("fp16", 16, note="native float16"),
    "fp8": KVFormat(
        "fp8", 8, scale_bytes=2, note="e4m3 payload + one fp16 scale per token per KV head (K and V each)"
    ),
    "int8": KVFormat(
        "int8", 8, scale_bytes=2, note="symmetric int8 + one fp16 scale per token per KV head (K and V each)"
    ),
    "kivi4": KVFormat(
        "kivi4", 4, scale_bytes=4, group_size=KIVI_GROUP, residual_tokens=KIVI_RESIDUAL,
        note="KIVI 4-bit: fp16 scale + fp16 zero per 32 elements; the still-filling block (32 tokens) kept in fp16",
    ),
    "kivi2": KVFormat(
        "kivi2", 2, scale_bytes=4, group_size=KIVI_GROUP, residual_tokens=KIVI_RESIDUAL,
        note="KIVI 2-bit: fp16 scale + fp16 zero per 32 elements; the still-filling block (32 tokens) kept in fp16",
    ),
}

KV_FORMAT_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "e4m3": "fp8", "e5m2": "fp8",
}


def suggest(name: str, choices) -> str:
    """A ' Did you mean ...?' hint listing close names, or a list of valid names."""
    close = difflib.get_close_matches(name.lower(), [c.lower() for c in choices], n=3, cutoff=0.5)
    if close:
        return " Did you mean: " + ", ".join(close) + "?"
    return " Choose one of: " + ", ".join(sorted(choices)) + "."


def get_kv_format(name: str) -> KVFormat:
    """Look up a KV format by name (case-insensitive); ValueError with suggestions if unknown."""
    key = name.strip().lower()
    key = KV_FORMAT_ALIASES.get(key, key)
    if key not in KV_FORMATS:
        raise ValueError(f"unknown KV format {name!r}." + suggest(name, KV_FORMATS))
    return KV_FORMATS[key]


def bytes_per_element(fmt: KVFormat, vector_len: int) -> float:
    """Average stored bytes per KV element in `fmt`, scale/zero metadata included."""
    group = fmt.group_size or vector_len
    return fmt.bits / 8 + fmt.scale_bytes / group


# --- attention layout ------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """What a model's attention layers cache per token.

    MHA: num_kv_heads == num_heads; GQA: fewer; MQA: 1. MLA when `kv_lora_rank > 0`
    (then num_kv_heads and head_dim are ignored). `num_local_layers` of the `num_layers`
    layers keep at most `sliding_window` tokens; the others keep the whole context.
    """

    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    sliding_window: int = 0
    num_local_layers: int = 0

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (one latent vector per token per layer)."""
        return self.kv_lora_rank > 0

    @property
    def num_global_layers(self) -> int:
        """Layers whose cache grows with the whole context."""
        return self.num_layers - self.num_local_layers

    @property
    def vector_len(self) -> int:
        """Elements in one cached vector: a K or V head, or the MLA latent plus rope key."""
        return self.kv_lora_rank + self.rope_dim if self.is_mla else self.head_dim


def check_layout(layout: KVLayout) -> None:
    """Raise ValueError if the layout's numbers cannot describe a model."""
    if layout.num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {layout.num_layers}")
    if layout.is_mla:
        if layout.rope_dim < 0:
            raise ValueError(f"rope_dim must be >= 0, got {layout.rope_dim}")
    elif layout.num_kv_heads <= 0 or layout.head_dim <= 0:
        raise ValueError(
            f"num_kv_heads and head_dim must be positive (got {layout.num_kv_heads}, "
            f"{layout.head_dim}); for MLA give kv_lora_rank instead"
        )
    if not 0 <= layout.num_local_layers <= layout.num_layers:
        raise ValueError(f"num_local_layers must be in [0, {layout.num_layers}], got {layout.num_local_layers}")
    if layout.num_local_layers and layout.sliding_window <= 0:
        raise ValueError("local layers need a positive sliding_window")


def attention_kind(layout: KVLayout, num_heads: int = 0) -> str:
    """'MLA', 'MQA', 'MHA' or 'GQA'; 'MHA/GQA' when num_heads (query heads) is unknown (0)."""
    if layout.is_mla:
        return "MLA"
    if layout.num_kv_heads == 1:
        return "MQA"
    if not num_heads:
        return "MHA/GQA"
    return "MHA" if layout.num_kv_heads == num_heads else "GQA"


# --- tensor parallelism ----------------------------------------------------------------------


def kv_heads_per_gpu(num_kv_heads: int, num_gpus: int) -> int:
    """KV heads each GPU stores under tensor parallelism: a share, or 1 (replicated) if too few."""
    if num_gpus <= 0:
        raise ValueError(f"num_gpus must be positive, got {num_gpus}")
    return max(1, math.ceil(num_kv_heads / num_gpus))


def kv_replication(layout: KVLayout, num_gpus: int) -> float:
    """Stored KV heads over all GPUs divided by the model's KV heads (1.0 = each stored once)."""
    if num_gpus <= 1:
        return 1.0
    if layout.is_mla:
        return float(num_gpus)  # one latent serves all heads, so every GPU keeps all of it
    return kv_heads_per_gpu(layout.num_kv_heads, num_gpus) * num_gpus / layout.num_kv_heads


def vectors_per_token_layer(layout: KVLayout, num_gpus: int = 1) -> int:
    """KV vectors one GPU caches per token per layer: 2 * KV heads on that GPU, or 1 for MLA."""
    if layout.is_mla:
        return 1
    return 2 * kv_heads_per_gpu(layout.num_kv_heads, num_gpus)


# --- bytes per token and per sequence ---------------------------------------------------------


def layer_bytes_per_token(layout: KVLayout, fmt: KVFormat, num_gpus: int = 1) -> float:
    """Bytes one more (quantized) token adds to one layer's cache on one GPU."""
    n = layout.vector_len
    return vectors_per_token_layer(layout, num_gpus) * n * bytes_per_element(fmt, n)


def layout_bytes_per_token(layout: KVLayout, fmt: KVFormat, num_gpus: int = 1) -> int:
    """Bytes per token across all layers on one GPU, ignoring windows and residual buffers."""
    return math.ceil(layout.num_layers * layer_bytes_per_token(layout, fmt, num_gpus))


def cached_tokens(context: int, sliding_window: int = 0) -> int:
    """Tokens a layer keeps for a sequence of `context` tokens (capped at the window if any)."""
    return min(context, sliding_window) if sliding_window > 0 else context


def layer_bytes(layout: KVLayout, fmt: KVFormat, tokens: int, num_gpus: int = 1) -> float:
    """Bytes one layer holds for `tokens` cached tokens, full-precision residual included.

    The residual is counted as min(tokens, residual_tokens) for both K and V (an upper bound:
    KIVI's keys hold between 0 and R tokens unquantized, its values exactly the last R).
    """
    residual = min(tokens, fmt.residual_tokens)
    vectors = vectors_per_token_layer(layout, num_gpus) * layout.vector_len
    quantized = (tokens - residual) * layer_bytes_per_token(layout, fmt, num_gpus)
    return quantized + residual * vectors * fmt.residual_bytes


def kv_bytes_per_sequence(layout: KVLayout, fmt: KVFormat, context: int, num_gpus: int = 1) -> int:
    """Bytes one sequence of `context` tokens holds on one GPU (windows and residual included)."""
    check_context(context)
    local = layout.num_local_layers * layer_bytes(
        layout, fmt, cached_tokens(context, layout.sliding_window), num_gpus
    )
    full = layout.num_global_layers * layer_bytes(layout, fmt, context, num_gpus)
    return math.ceil(local + full)


def check_context(context: int) -> None:
    """Raise ValueError unless context is a positive token count."""
    if context <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context}")


# --- weights, budget, capacity ----------------------------------------------------------------

WEIGHT_DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def get_weight_dtype_bytes(name: str) -> float:
    """Bytes per parameter for a weight dtype name; ValueError with suggestions if unknown."""
    key = KV_FORMAT_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in WEIGHT_DTYPE_BYTES:
        raise ValueError(f"unknown weight dtype {name!r}." + suggest(name, WEIGHT_DTYPE_BYTES))
    return WEIGHT_DTYPE_BYTES[key]


def moe_params_read(num_params: float, active_params: float, num_experts: int,
                    experts_per_token: int, batch: int) -> float:
    """Parameters a decode step of `batch` tokens reads from a mixture-of-experts model.

    Assumes uniform routing: each token picks `experts_per_token` of `num_experts` per layer, so
    a batch touches a share 1 - (1 - k/E)^batch of the routed experts. batch 1 gives the active
    parameters; large batches approach all parameters. Dense models (no experts) read all.
    """
    if not num_experts or not active_params or experts_per_token >= num_experts:
        return num_params
    k, e = experts_per_token, num_experts
    routed = (num_params - active_params) * e / (e - k)
    touched = 1 - (1 - k / e) ** max(batch, 1)
    return num_params - routed + routed * touched


def kv_budget_bytes(memory_bytes: float, weight_bytes_per_gpu: float,
                    gpu_memory_utilization: float = 0.9, reserved_fraction: float = 0.0) -> int:
    """Bytes left for KV on one GPU: memory * utilization, less the reserve, less the weights.

    `reserved_fraction` is a share of the utilized memory held back for activations and
    temporary buffers. Negative (weights do not fit) is returned as is, for the caller to say so.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not 0 <= reserved_fraction < 1:
        raise ValueError(f"reserved_fraction must be in [0, 1), got {reserved_fraction}")
    usable = memory_bytes * gpu_memory_utilization * (1 - reserved_fraction)
    return math.floor(usable - weight_bytes_per_gpu)


def max_concurrent_sequences(kv_budget: float, bytes_per_sequence: int) -> int:
    """How many sequences of `bytes_per_sequence` fit in a KV budget (0 if none)."""
    if kv_budget <= 0:
        return 0
    return int(kv_budget // bytes_per_sequence)


# --- decode-step reads and the bandwidth bound ------------------------------------------------


def decode_bytes_read(weight_bytes: float, kv_bytes_per_seq: float, batch: int) -> float:
    """Bytes one decode step reads: every weight once plus every sequence's whole cache."""
    return weight_bytes + batch * kv_bytes_per_seq


def time_per_output_token(bytes_read: float, bandwidth_bytes_per_s: float) -> float:
    """Lower bound on seconds per decode step when memory bandwidth is the only limit."""
    return bytes_read / bandwidth_bytes_per_s


def tokens_per_second_ceiling(batch: int, seconds_per_step: float) -> float:
    """Upper bound on generated tokens per second for the whole batch."""
    return batch / seconds_per_step if seconds_per_step > 0 else math.inf


# --- compute the cache saves (for `kvserve analyze`) ------------------------------------------


def kv_projection_rows(prompt_tokens: int, new_tokens: int, cached: bool) -> int:
    """Token rows pushed through k_proj (per layer) to generate `new_tokens` after a prompt.

    With a cache: the prompt once, then one row per step for the token just sampled
    (the last sampled token is never fed back): P + N - 1. Without: step k (1..N) recomputes
    all P + k - 1 tokens seen so far: N*P + N(N-1)/2. P = 1 gives N and N(N+1)/2.
    """
    p, n = prompt_tokens, new_tokens
    if n <= 0:
        return 0
    if cached:
        return p + n - 1
    return n * p + n * (n - 1) // 2


def kv_work_avoided(num_tokens: int) -> float:
    """Share of K/V projection rows a cache avoids over N tokens: (N^2 - N) / (N^2 + N)."""
    n = num_tokens
    return (n * n - n) / (n * n + n)
