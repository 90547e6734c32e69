"""Attention backends: one per KV group, chosen once at start-up (`select_backend`).

A backend knows where its group's K/V live and how to read them; the layer brings the formula
(kvserve/attention/math.py: MHA or absorbed MLA). Each step, `prepare` builds the group's
metadata from the step batch; `forward` writes a layer's new entries and attends.

- NoCacheBackend: no cache; every prefill span attends over its own rows (the recompute oracle).
- GatheredBackend: any storage format (quantized, KIVI, rotated, MLA latents): the entries a row
  attends over are gathered by slot and decoded through the format's codec; attention scores can
  be handed to KV eviction (score hook).
- PagedBackend: native K/V (model dtype, no rotation): decodes read the pools by block id, in
  place with the C++ kernel on CPU (attention/cpu/) or whole blocks through torch
  (attention/paged.py); prefill chunks as GatheredBackend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvserve.attention import cpu as cpu_kernel
from kvserve.attention.metadata import (
    AttentionMetadata,
    Context,
    DecodeChunks,
    DecodeRange,
    GatheredMetadata,
    PagedMetadata,
    PrefillSpan,
    window_mask,
)
from kvserve.attention.paged import paged_decode, plan_chunks
from kvserve.kv.spec import KVGroup
from kvserve.kv.storage import KVStorage

# Decode attention reads blocks in chunks of about this many tokens (PagedBackend).
DECODE_CHUNK_TOKENS = 64


@dataclass
class StepBatch:
    """The step's requests in batch order (decodes first), for every group's `prepare` (which also
    gets the group's block tables [R, W] of these requests, in this order)."""

    num_decodes: int
    counts: list[int]            # [R] new tokens per request
    token_req: torch.Tensor      # [T] request index of each new token
    token_off: torch.Tensor      # [T] offset of each new token among its request's new tokens
    cache_lens: list[list[int]]  # per group: [R] entries the group holds per request before this step
    cache_len_t: list[torch.Tensor]  # the same as tensors


class NoCacheBackend:
    """No KV cache: each span attends over its own new rows (causal, or a sliding window). The
    attention of a step whose metadata has no backends."""

    def attend(self, layer: int, q, new: list[torch.Tensor], meta: AttentionMetadata, scale: float,
               window: int | None, math) -> torch.Tensor:
        out = q.new_empty(math.out_shape(q, new))
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_tokens)
            mask = None
            if window is not None and span.num_tokens > window:
                pos = torch.arange(span.num_tokens, device=q.device)
                mask = window_mask(pos, pos, window)
            out[rows] = math.prefill(q[rows], [x[rows] for x in new], mask, scale)
        return out


NO_CACHE = NoCacheBackend()


class GatheredBackend:
    """Any KV format: entries gathered by slot through the storage's codecs."""

    def __init__(self, storage: KVStorage, group: KVGroup):
        self.storage = storage
        self.spec = group.spec
        self.layers = group.layers
        self.block_size = storage.block_size
        self.window = self.spec.visible_window

    # ---- metadata ----------------------------------------------------------------------------
    metadata = GatheredMetadata   # the type `prepare` builds

    def prepare(self, step: StepBatch, g: int, table: torch.Tensor):
        md = self.metadata(slot_mapping=self._slot_mapping(step, g, table))
        if step.num_decodes:
            self._prepare_decodes(md, step, g, table)
        for r in range(step.num_decodes, len(step.counts)):
            idx, mask = self._prefill_view(table[r], step.cache_lens[g][r], step.counts[r])
            md.prefill_idx.append(idx)
            md.prefill_mask.append(mask)
        return md

    def _slot_mapping(self, step: StepBatch, g: int, table: torch.Tensor) -> torch.Tensor:
        pos = step.cache_len_t[g][step.token_req] + step.token_off
        return table[step.token_req, pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_range(self, step: StepBatch, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[start, end) of the positions each decode attends over: all of it, or the last `window`."""
        end = step.cache_len_t[g][:step.num_decodes] + 1
        start = (end - self.window).clamp(min=0) if self.window else torch.zeros_like(end)
        return start, end

    def _prepare_decodes(self, md: GatheredMetadata, step: StepBatch, g: int, table: torch.Tensor) -> None:
        start, end = self._decode_range(step, g)
        bs = self.block_size
        width = max(1, -(-(max(step.cache_lens[g][:step.num_decodes]) + 1) // bs))
        tab = table[:step.num_decodes, :width]
        length = int((end - start).max())
        p = start[:, None] + torch.arange(length, device=tab.device)[None, :]      # [B, L] positions
        visible = p < end[:, None]
        p = torch.minimum(p, end[:, None] - 1)
        md.decode_idx = tab.gather(1, p // bs) * bs + p % bs
        md.decode_mask = visible[:, None, None, :]

    def _prefill_view(self, table_row: torch.Tensor, cached: int, n: int):
        """A chunk attends over its cached prefix (trimmed to the window) plus itself."""
        ctx, q0 = cached + n, cached
        window = self.window
        k0 = max(0, q0 - window + 1) if window else 0
        p = torch.arange(k0, ctx, device=table_row.device)
        idx = table_row[p // self.block_size] * self.block_size + p % self.block_size
        if k0 == 0 and q0 == 0 and (window is None or n <= window):
            return idx, None
        return idx, window_mask(torch.arange(q0, ctx, device=idx.device), p, window)

    # ---- attention ---------------------------------------------------------------------------
    def forward(self, layer: int, q, new: list[torch.Tensor], meta: AttentionMetadata, md: GatheredMetadata,
                scale: float, window: int | None, math) -> torch.Tensor:
        """Write the layer's new entries at their slots and attend with `md`, this group's metadata."""
        rot = self.storage.rotation(layer) if math.rotates else None
        if rot is not None:  # orthonormal: q k^T unchanged; the cache sees k H and v H (formats.py)
            q, new = q @ rot, [x @ rot for x in new]
        self.storage.write(layer, md.slot_mapping, *new)
        out = q.new_empty(math.out_shape(q, new))
        for ctx in self._contexts(layer, meta, md, new, window):
            attend = math.decode if ctx.batched else math.prefill
            out[ctx.rows] = attend(q[ctx.rows], ctx.entries, ctx.mask, scale)
            if md.scores is not None:
                md.scores(layer, ctx, q[ctx.rows], math.score_keys(ctx.entries), scale)
        return out if rot is None else out @ rot.mT

    def _contexts(self, layer, meta, md: GatheredMetadata, new, window) -> list[Context]:
        storage = self.storage
        own = storage.has_own_block_view(layer)  # KIVI: a query sees its own block's keys exact
        out = []
        if meta.num_decodes:
            own_blocks = md.slot_mapping[:meta.num_decodes] // storage.block_size if own else None
            out.append(Context(slice(0, meta.num_decodes), storage.read(layer, md.decode_idx, own_blocks),
                               md.decode_mask, True))
        for span, idx, mask in zip(meta.prefills, md.prefill_idx, md.prefill_mask):
            rows = slice(span.start, span.start + span.num_tokens)
            if own:
                out.append(_own_block_context(layer, storage, span, idx, [x[rows] for x in new], window))
            else:
                out.append(Context(rows, storage.read(layer, idx), mask, False))
        return out


class PagedBackend(GatheredBackend):
    """Native K/V: decode rows read the pools by block id: in place through the CPU kernel
    (`use_kernel`, attention/cpu/), or whole blocks gathered by torch (attention/paged.py)."""

    metadata = PagedMetadata

    def __init__(self, storage: KVStorage, group: KVGroup, use_kernel: bool = False):
        super().__init__(storage, group)
        self.blocks_per_chunk = max(1, DECODE_CHUNK_TOKENS // self.block_size)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.kernel = use_kernel and _cpu_kernel_reads(storage, group)

    def _prepare_decodes(self, md: PagedMetadata, step: StepBatch, g: int, table: torch.Tensor) -> None:
        start, end = self._decode_range(step, g)
        width = max(1, -(-(max(step.cache_lens[g][:step.num_decodes]) + 1) // self.block_size))
        md.decode = DecodeRange(table[:step.num_decodes, :width], start, end)
        if not self.kernel:
            self._chunks(md)

    def _chunks(self, md: PagedMetadata) -> DecodeChunks:
        """The torch path's block chunks, planned once per step."""
        if md.chunks is None:
            d = md.decode
            md.chunks = plan_chunks(d.tables, d.start, d.end, self.block_size, self.blocks_per_chunk)
            pool = self.storage.native_kv(self.layers[0])[0]
            md.chunks.workspace = [self._buffer(i, pool, md.chunks.blocks.numel()) for i in range(2)]
        return md.chunks

    def _buffer(self, i: int, pool: torch.Tensor, n: int) -> torch.Tensor:
        """Buffer i shaped [n, *pool.shape[1:]], grown by doubling and reused across layers and steps:
        a fresh tens-of-MB tensor per layer would be mmapped and page-faulted in at every call."""
        buf = self._buffers.get(i)
        if buf is None or buf.shape[0] < n:
            size = max(n, 2 * (buf.shape[0] if buf is not None else 0))
            buf = torch.empty((size, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
            self._buffers[i] = buf
        return buf[:n]

    def forward(self, layer: int, q, new: list[torch.Tensor], meta: AttentionMetadata, md: PagedMetadata,
                scale: float, window: int | None, math) -> torch.Tensor:
        self.storage.write(layer, md.slot_mapping, *new)
        out = q.new_empty(math.out_shape(q, new))
        d = meta.num_decodes
        if d:
            k_pool, v_pool = self.storage.native_kv(layer)
            if self.kernel and cpu_kernel.reads(q.dtype, k_pool.dtype):
                r = md.decode
                cpu_kernel.paged_decode(q[:d], k_pool, v_pool, r.tables, r.start, r.end, scale, out=out[:d])
            else:
                out[:d] = paged_decode(q[:d], k_pool, v_pool, self._chunks(md), scale)
        for span, idx, mask in zip(meta.prefills, md.prefill_idx, md.prefill_mask):
            rows = slice(span.start, span.start + span.num_tokens)
            out[rows] = math.prefill(q[rows], self.storage.read(layer, idx), mask, scale)
        return out


def _cpu_kernel_reads(storage: KVStorage, group: KVGroup) -> bool:
    """True when the CPU decode kernel reads every layer's pools of the group and builds here."""
    pools = [p for layer in group.layers for p in storage.native_kv(layer)]
    return all(cpu_kernel.supports(p) for p in pools) and cpu_kernel.kernel()


def select_backend(storage: KVStorage, group: KVGroup, observed: bool, kind: str = "auto") -> GatheredBackend:
    """The group's backend. `kind` 'triton' (or 'auto' on CUDA with triton installed) picks the
    Triton kernels (FlashInfer first for native 16-bit caches under 'auto', when installed) where
    they read the group's format and no KV eviction watches its attention scores. Otherwise
    PagedBackend when every layer keeps plain K/V in the model dtype and nothing watches the
    scores (with the CPU decode kernel under 'auto', torch's ops under 'torch'); GatheredBackend
    else. 'invariant' (the batch-invariant mode): attention/invariant.py's InvariantBackend."""
    if kind == "invariant":
        from kvserve.attention.invariant import InvariantBackend  # it builds on PagedBackend
        return InvariantBackend(storage, group)
    if kind != "torch" and not observed:
        fast = _kernel_backend(storage, group, kind)
        if fast is not None:
            return fast
    native = group.spec.per_head and all(
        storage.native_kv(layer) is not None and storage.rotation(layer) is None for layer in group.layers)
    if native and not observed:
        return PagedBackend(storage, group, use_kernel=kind == "auto")
    return GatheredBackend(storage, group)


class AttentionBackends:
    """The step's attention: one backend per KV group, each layer routed to its group's. `metadata`
    builds a step's AttentionMetadata (every group's part by that group's backend); the model's
    layers reach `attend` through it."""

    def __init__(self, backends: list, layer_group: dict[int, int], observed: frozenset[int] = frozenset()):
        self.backends = backends
        self.layer_group = layer_group
        self.observed = observed   # groups whose attention scores KV eviction watches
        self._of_layer = {layer: (backends[g], g) for layer, g in layer_group.items()}

    @classmethod
    def select(cls, storage: KVStorage, groups: list[KVGroup], kind: str = "auto",
               observed: frozenset[int] = frozenset()) -> AttentionBackends:
        """Each group's backend by `select_backend`, once."""
        chosen = [select_backend(storage, group, g in observed, kind) for g, group in enumerate(groups)]
        return cls(chosen, dict(storage.layer_group), observed)

    def metadata(self, step: StepBatch, tables: list[torch.Tensor], prefills: list[PrefillSpan],
                 scores=None) -> AttentionMetadata:
        """The step's metadata over the groups' block tables [R, W] (batch order); `scores`, KV
        eviction's callback for this step, goes to the groups it watches."""
        groups = [b.prepare(step, g, tables[g]) for g, b in enumerate(self.backends)]
        if scores is not None:
            for g in self.observed:
                groups[g].scores = scores
        return AttentionMetadata(step.num_decodes, prefills, self, groups)

    def attend(self, layer: int, q, new: list[torch.Tensor], meta: AttentionMetadata, scale: float,
               window: int | None, math) -> torch.Tensor:
        backend, g = self._of_layer[layer]
        return backend.forward(layer, q, new, meta, meta.groups[g], scale, window, math)

    @property
    def paged(self) -> bool:
        """True when every group is read by PagedBackend (the captured one-token step's condition)."""
        return all(type(b) is PagedBackend for b in self.backends)

    def names(self, detail: bool = False) -> list[str]:
        """The backend class of each KV group (for logs and tests); with `detail`, how PagedBackend
        decodes (the C++ CPU kernel or torch's ops)."""
        names = [type(b).__name__ for b in self.backends]
        if detail:
            names = [f"{n} ({'CPU kernel' if b.kernel else 'torch ops'})" if isinstance(b, PagedBackend) else n
                     for n, b in zip(names, self.backends)]
        return names


def _kernel_backend(storage: KVStorage, group: KVGroup, kind: str):
    """A kernel backend (kvserve/attention/triton/) for the group, or None; imports lazily."""
    from kvserve.attention import triton as kernels

    cuda = storage.slots[0][0].device.type == "cuda"
    if kind == "auto" and not cuda:
        return None
    if not kernels.available():
        if kind == "triton":
            raise ValueError("attention_backend='triton' needs the triton package: pip install 'kvserve[triton]'")
        return None
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' off CUDA runs the Triton interpreter: set TRITON_INTERPRET=1")
    from kvserve.attention.triton.backend import TritonBackend, supports
    from kvserve.attention.triton.flashinfer import flashinfer_backend

    if kind == "auto":
        fi = flashinfer_backend(storage, group)
        if fi is not None:
            return fi
    return TritonBackend(storage, group) if supports(storage, group) else None


def _own_block_context(layer: int, storage: KVStorage, span, idx: torch.Tensor,
                       fresh: list[torch.Tensor], window: int | None) -> Context:
    """A prefill chunk over a KIVI cache: each query sees earlier blocks as stored (quantized) and
    its own block's tokens exact, as a decode step would, so results do not depend on chunking."""
    bs = storage.block_size
    ctx, n = span.context_len, span.num_tokens
    q0, k0 = ctx - n, ctx - idx.numel()
    b0 = max(k0, q0 // bs * bs)                       # first position some query needs exact
    stored = storage.read(layer, idx)                 # [ctx - k0, ...] each
    exact = storage.exact_view(layer, idx[q0 - k0:], fresh)
    if b0 < q0:
        exact = [torch.cat([o, x]) for o, x in zip(storage.exact_view(layer, idx[b0 - k0:q0 - k0]), exact)]
    dev = idx.device
    q_pos, k_pos, e_pos = (torch.arange(a, ctx, device=dev) for a in (q0, k0, b0))
    own_start = (q_pos // bs * bs)[:, None]
    mask = torch.cat([window_mask(q_pos, k_pos, window) & (k_pos[None, :] < own_start),
                      window_mask(q_pos, e_pos, window) & (e_pos[None, :] >= own_start)], dim=1)
    return Context(slice(span.start, span.start + n), [torch.cat([s, x]) for s, x in zip(stored, exact)],
                   mask, False)
