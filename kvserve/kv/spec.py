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
    def entry_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the per-token tensors: K and V, or one MLA latent (+ rope key)."""
        if self.kind == "mla":
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


def first_needed_block(spec: KVSpec, num_computed: int, block_size: int) -> int:
    """Blocks before this index hold only tokens no future query of a sliding layer can see."""
    if spec.kind != "sliding":
        return 0
    first_useful = num_computed - spec.window + 1
    return max(0, first_useful // block_size)
