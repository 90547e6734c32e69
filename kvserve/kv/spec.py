"""What each layer stores per token, and how layers group into KV cache groups."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVSpec:
    """Per-layer KV layout: full attention, sliding window, or MLA latent."""

    kind: str                  # "full" | "sliding" | "mla"
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None  # sliding: a query at position i sees keys in (i - window, i]
    latent_dim: int = 0        # mla: kv_lora_rank
    rope_dim: int = 0          # mla: decoupled RoPE key width

    def __post_init__(self):
        if self.kind not in ("full", "sliding", "mla"):
            raise ValueError(f"KV spec kind must be full, sliding or mla, got {self.kind!r}")
        if self.kind == "sliding" and not self.window:
            raise ValueError("a sliding KV spec needs a window >= 1")

    @property
    def keeps_window(self) -> bool:
        """True when a layer keeps only its last `window` tokens (a sliding layer): a prefix hit does
        not need its earlier blocks, and eviction policies leave it alone."""
        return self.kind == "sliding"

    @property
    def latent(self) -> bool:
        """True for one MLA latent per token (no per-head K and V)."""
        return self.kind == "mla"

    @property
    def per_head(self) -> bool:
        """True when a token stores K and V per KV head (full or sliding attention)."""
        return not self.latent

    @property
    def visible_window(self) -> int | None:
        """How many of the latest tokens a query sees (None: all of them)."""
        return self.window if self.keeps_window else None

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a lone sequence of `num_tokens` tokens holds at most in a layer of this spec: all
        of them, or a window's worth plus the one it starts in."""
        n = -(-num_tokens // block_size)
        return min(n, -(-self.window // block_size) + 1) if self.keeps_window else n

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """Blocks before this index hold only tokens no future query can see (sliding layers)."""
        if not self.keeps_window:
            return 0
        return max(0, (num_computed - self.window + 1) // block_size)

    @property
    def entry_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the per-token tensors: K and V, or one MLA latent (+ rope key)."""
        if self.latent:
            return [(self.latent_dim + self.rope_dim,)]
        return [(self.num_kv_heads, self.head_dim)] * 2

    def elements_per_token(self) -> int:
        """Numbers stored per token for one layer."""
        return sum(math.prod(s) for s in self.entry_shapes)

    def bytes_per_token(self, dtype_bytes: float) -> int:
        """Bytes one token takes in one layer."""
        return int(math.ceil(self.elements_per_token() * dtype_bytes))


@dataclass
class KVGroup:
    """Layers with the same spec that share one block table per request."""

    spec: KVSpec
    layers: list[int]


def group_layers(specs: list[KVSpec], size: int | None = None) -> list[KVGroup]:
    """Split layers into groups of equal size (same spec inside a group), so pages are uniform.

    `size=1` gives every layer its own group, hence its own block table per request: layers may
    then hold different numbers of tokens (KV eviction, kv/policies.py)."""
    by_spec: dict[KVSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(layer)
    shapes = {tuple(s.entry_shapes) for s in by_spec}
    if len(shapes) > 1:
        raise ValueError(f"layers with different per-token shapes cannot share one pool: {shapes}")
    gcd = math.gcd(*(len(v) for v in by_spec.values()))
    if size is not None and (size < 1 or gcd % size):
        raise ValueError(f"group size {size} must divide every spec's layer count (gcd {gcd})")
    size = size or gcd
    groups = []
    for spec, layers in by_spec.items():
        groups.extend(KVGroup(spec, layers[i:i + size]) for i in range(0, len(layers), size))
    return groups


def null_blocks(groups: list[KVGroup]) -> int:
    """Blocks the pool reserves: one null block where a sliding group's dropped entries point."""
    return 1 if any(g.spec.keeps_window for g in groups) else 0
