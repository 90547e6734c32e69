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
class SlotMetadata:
    """Where one KV group's new tokens are written this step (every backend's metadata has it)."""

    slot_mapping: torch.Tensor                 # [num_tokens] slots of the new tokens


@dataclass
class SpanMetadata(SlotMetadata):
    """And the slots each prefill span attends over, with their visibility."""

    prefill_idx: list[torch.Tensor] = field(default_factory=list)          # per span: [ctx_g] slots
    prefill_mask: list[torch.Tensor | None] = field(default_factory=list)  # per span: [n, ctx_g] or None = causal


@dataclass
class GatheredMetadata(SpanMetadata):
    """GatheredBackend's: the slots each decode row attends over too."""

    decode_idx: torch.Tensor | None = None     # [num_decodes, L] slots each decode attends over (padded)
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, 1, L] bool
    # KV eviction (kv/evictor.py), for groups whose attention scores it watches: called as
    # scores(layer, ctx, q[ctx.rows], keys, scale) for every context, so H2O / SnapKV can see the
    # attention their requests' cached entries receive.
    scores: Callable | None = None


@dataclass
class DecodeRange:
    """The decode rows' block tables and the positions [start, end) each attends over."""

    tables: torch.Tensor    # [B, W] block ids
    start: torch.Tensor     # [B]
    end: torch.Tensor       # [B]


@dataclass
class PagedMetadata(SpanMetadata):
    """PagedBackend's: decode rows read the pools by block id."""

    decode: DecodeRange | None = None
    chunks: DecodeChunks | None = None         # the torch path's blocks of the decode rows, planned once a step


@dataclass
class CapturedInputs:
    """What the captured decode step (engine/captured_step.py) runs its decode rows with: the fixed
    parts (the attention op, the distinct pool tensors, each layer's (K, V) index among them and its
    KV group, the native decode stack where it is built) and this step's, per group: the rows'
    slots, what they read (one token: its visible blocks [n] and the visible positions [2] among
    them; 2 to STACK_ROWS rows: their block tables [R, W] and each row's visible positions [2, R],
    starts then ends)."""

    decode: Callable
    pools: tuple[torch.Tensor, ...]
    kv_index: tuple[tuple[int, int], ...]
    slots: tuple[torch.Tensor, ...]
    blocks: tuple[torch.Tensor, ...]
    spans: tuple[torch.Tensor, ...]
    groups: tuple[int, ...]
    stack: Callable | None = None   # the native decode stack that runs the step, where it is built

    def args(self) -> tuple:
        """The graph's inputs after (layers, x, positions), in its argument order."""
        return self.decode, self.pools, self.kv_index, self.slots, self.blocks, self.spans, self.groups


@dataclass
class Context:
    """Rows of the flat batch and the cached entries (K, V or latent) they attend over."""

    rows: slice
    entries: list[torch.Tensor]   # decode: [B, L, ...]; prefill: [ctx, ...]
    mask: torch.Tensor | None
    batched: bool                 # True for the decode batch


@dataclass
class AttentionMetadata:
    """What attention needs to know about the flat batch (decode rows come first)."""

    num_decodes: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The step's attention: the KV groups' backends (attention/backends.py AttentionBackends, chosen
    # once at start-up) and each group's metadata, built by its backend. None: no cache, every span
    # attends over its own rows.
    backends: object | None = None
    groups: list | None = None
    # Decode rows only (1 to STACK_ROWS) over native paged K/V in every layer: the captured step's
    # inputs (its graph writes and reads the cache itself, model/regions.py); None: attention goes
    # through the backends.
    captured: CapturedInputs | None = None
    # Callbacks (layer, q, k, v, scale, window) that see every `attend` call of this forward (KV
    # calibration's capture of the model's queries, keys and values).
    observers: tuple = ()


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility [len(q_pos), len(k_pos)]."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask
