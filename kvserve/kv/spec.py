"""What each layer stores per token, and how layers group into KV cache groups."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class KVSpec:
    """What one layer stores per token. A layout is one of the types below (vLLM's
    FullAttentionSpec / SlidingWindowSpec / MLAAttentionSpec); each answers for itself what its
    callers ask, so no caller tests a kind."""

    kind: ClassVar[str]                # the layout's name, for logs, the KV state and the dashboard
    keeps_window: ClassVar[bool] = False   # keeps only its last `window` tokens: a prefix hit does not
    #                                        need its earlier blocks, and eviction policies leave it alone
    latent: ClassVar[bool] = False     # one MLA latent per token (no per-head K and V)

    @property
    def per_head(self) -> bool:
        """True when a token stores K and V per KV head (full or sliding attention)."""
        return not self.latent

    @property
    def visible_window(self) -> int | None:
        """How many of the latest tokens a query sees (None: all of them)."""
        return None

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a lone sequence of `num_tokens` tokens holds at most in a layer of this spec."""
        return -(-num_tokens // block_size)

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """Blocks before this index hold only tokens no future query can see."""
        return 0

    @property
    def entry_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the per-token tensors: K and V, or one MLA latent (+ rope key)."""
        raise NotImplementedError

    def elements_per_token(self) -> int:
        """Numbers stored per token for one layer."""
        return sum(math.prod(s) for s in self.entry_shapes)

    def bytes_per_token(self, dtype_bytes: float) -> int:
        """Bytes one token takes in one layer."""
        return int(math.ceil(self.elements_per_token() * dtype_bytes))


@dataclass(frozen=True)
class _PerHeadSpec(KVSpec):
    """K and V per KV head for every token it keeps (full and sliding-window attention)."""

    num_kv_heads: int = 0
    head_dim: int = 0

    @property
    def entry_shapes(self) -> list[tuple[int, ...]]:
        return [(self.num_kv_heads, self.head_dim)] * 2


@dataclass(frozen=True)
class FullSpec(_PerHeadSpec):
    """Full attention: K and V per KV head for every token."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True)
class SlidingWindowSpec(_PerHeadSpec):
    """Sliding-window attention: a query at position i sees keys in (i - window, i]."""

    window: int = 0
    kind: ClassVar[str] = "sliding"
    keeps_window: ClassVar[bool] = True

    def __post_init__(self):
        if not self.window or self.window < 1:
            raise ValueError(f"a sliding-window KV spec needs a window >= 1, got {self.window}")

    @property
    def visible_window(self) -> int:
        return self.window

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """A window's worth of blocks plus the one it starts in, at most."""
        return min(-(-num_tokens // block_size), -(-self.window // block_size) + 1)

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        return max(0, (num_computed - self.window + 1) // block_size)


@dataclass(frozen=True)
class MLASpec(KVSpec):
    """Multi-head latent attention: one latent of `latent_dim` (kv_lora_rank) plus a shared RoPE key
    of `rope_dim` per token."""

    latent_dim: int = 0
    rope_dim: int = 0
    kind: ClassVar[str] = "mla"
    latent: ClassVar[bool] = True

    @property
    def entry_shapes(self) -> list[tuple[int, ...]]:
        return [(self.latent_dim + self.rope_dim,)]


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
