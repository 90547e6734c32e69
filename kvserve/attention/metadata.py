"""What attention knows about one step: the flat batch layout and, per KV group, where its layers
write and what they read (built by that group's backend, kvserve/attention/backends.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class PrefillSpan:
    """One request whose new tokens are not a single decode token."""

    start: int          # first row of its tokens in the flat batch
    num_tokens: int     # new tokens this step
    context_len: int    # cached + new tokens


@dataclass
class DecodeChunks:
    """The decode rows of one KV group as a ragged list of chunks, a chunk being up to
    `blocks_per_chunk` consecutive blocks of one row, read from the pool by block id."""

    blocks: torch.Tensor     # [P * blocks_per_chunk] block ids, chunk by chunk
    row: torch.Tensor        # [P] the decode row each chunk belongs to
    bias: torch.Tensor       # [P, 1, 1, blocks_per_chunk * block_size] float32: 0 visible, -inf not
    num_rows: int            # decode rows B
    one_per_row: bool        # P == B and chunk i is row i: no partial results to combine
    # Reused output buffers for the gathered K and V blocks (see PagedBackend._buffer).
    workspace: list[torch.Tensor] | None = None


@dataclass
class GroupMetadata:
    """Where one KV group's layers write and read this step."""

    slot_mapping: torch.Tensor                 # [num_tokens] slots of the new tokens
    decode_idx: torch.Tensor | None = None     # [num_decodes, L] slots each decode attends over (padded)
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, 1, L] bool
    prefill_idx: list[torch.Tensor] = field(default_factory=list)          # per span: [ctx_g] slots
    prefill_mask: list[torch.Tensor | None] = field(default_factory=list)  # per span: [n, ctx_g] or None = causal
    chunks: DecodeChunks | None = None         # PagedBackend (torch path): the decode rows' blocks
    # PagedBackend: the decode rows' block tables [B, W] and the [start, end) [B] each attends over
    decode_range: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class Context:
    """Rows of the flat batch and the cached entries (K, V or latent) they attend over."""

    rows: slice
    entries: list[torch.Tensor]   # decode: [B, L, ...]; prefill: [ctx, ...]
    mask: torch.Tensor | None
    batched: bool                 # True for the decode batch


def _no_cache(layer: int):
    from kvserve.attention.backends import NO_CACHE
    return NO_CACHE


@dataclass
class AttentionMetadata:
    """What attention needs to know about the flat batch (decode rows come first)."""

    num_decodes: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    groups: list[GroupMetadata] | None = None  # None: no cache, every span attends over its own rows
    # The backend of each layer, chosen once at start-up (ModelRunner); by default no cache.
    backend_of: Callable[[int], object] = _no_cache
    layer_group: dict[int, int] = field(default_factory=dict)
    # KV eviction (engine/eviction.py): called as score_hook(layer, ctx, q[ctx.rows], keys, scale) for
    # every context, so H2O / SnapKV can see the attention their requests' cached entries receive.
    score_hook: object | None = None
    # A single decode token over native paged K/V in every layer: (pools per layer, then per group
    # slot, blocks, bias, then each layer's group) for the compiled one-token stack, which writes
    # and reads the cache itself (model/regions.py); None: attention goes through the backends.
    one_token: tuple | None = None

    def group(self, layer: int) -> GroupMetadata:
        return self.groups[self.layer_group[layer]]


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility [len(q_pos), len(k_pos)]."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask
