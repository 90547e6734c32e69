"""Turns a SchedulerOutput into flat tensors, runs the model, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.request import Request
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.spec import KVSpec
from kvserve.kv.storage import KVStorage
from kvserve.model.attention import (
    AttentionMetadata,
    GroupView,
    PagedDecode,
    PrefillSpan,
    paged_decode_plan,
    window_mask,
)


@dataclass
class ModelInput:
    """Flat batch: decodes first, then prefill chunks."""

    input_ids: torch.Tensor            # [num_tokens]
    positions: torch.Tensor            # [num_tokens]
    meta: AttentionMetadata
    order: list[tuple[Request, int]]   # requests in batch order with their new-token counts
    logits_rows: list[int]             # row of the last token of each request that samples
    sampling_reqs: list[Request]       # requests owning those rows


DECODE_CHUNK_TOKENS = 64


class ModelRunner:
    """Owns the model and the KV storage; one `execute` per engine step."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager | None, storage: KVStorage | None,
                 device: torch.device):
        self.model = model
        self.kv = kv
        self.storage = storage
        self.device = device
        self.block_size = kv.block_size if kv is not None else 1
        self._in_place: dict[int, bool] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}
        # decode attention reads blocks in chunks of about DECODE_CHUNK_TOKENS (model/attention.py)
        self.blocks_per_chunk = max(1, DECODE_CHUNK_TOKENS // self.block_size)
        self.evictor = None  # engine/eviction.py: cache lengths, positions and scores of evicting requests

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], prompt_logprob_reqs=()):
        """Run one step; returns (input, logits [len(sampling_reqs), vocab], prompt logits per request)."""
        if self.kv is not None:
            self.storage.copy_blocks(self.kv.take_pending_copies())
        inp = self.prepare(scheduled)
        hidden = self.model(inp.input_ids, inp.positions, self.storage, inp.meta)
        logits = self.model.compute_logits(hidden[inp.logits_rows])
        return inp, logits, self._prompt_logits(inp, hidden, prompt_logprob_reqs)

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        """Build input ids, positions and attention metadata."""
        cached = self.kv is not None
        decodes = [(r, n) for r, n in scheduled if n == 1 and cached]
        prefills = [(r, n) for r, n in scheduled if not (n == 1 and cached)]
        order = decodes + prefills
        ids, pos, logits_rows, sampling = [], [], [], []
        for req, n in order:
            start = req.num_computed_tokens
            ids.extend(req.token_ids[start:start + n])
            shift = self.evictor.position_shift(req) if self.evictor is not None else 0
            pos.extend(range(start - shift, start - shift + n))
            if start + n == req.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampling.append(req)
        meta = AttentionMetadata(num_decodes=len(decodes))
        row = len(decodes)
        for req, n in prefills:
            meta.prefills.append(PrefillSpan(row, n, req.num_computed_tokens + n))
            row += n
        if cached:
            meta.groups = [self._group_view(g, order, decodes, prefills) for g in range(len(self.kv.groups))]
            if self.evictor is not None:
                meta.score_hook = self.evictor.score_hook(decodes, prefills)
        return ModelInput(self._tensor(ids), self._tensor(pos), meta, order, logits_rows, sampling)

    def _group_view(self, g: int, order, decodes, prefills) -> GroupView:
        spec = self.kv.groups[g].spec
        tables = {r.request_id: self._tensor(self.kv.block_ids(r.request_id, g)) for r, _ in order}
        slots = [self._slots(tables[r.request_id], self._cache_len(r, g), self._cache_len(r, g) + n)
                 for r, n in order]
        view = GroupView(slot_mapping=torch.cat(slots))
        if decodes:
            reqs = [r for r, _ in decodes]
            if self.reads_blocks_in_place(g):
                view.paged = self._paged_decode(reqs, tables, spec, g)
            else:
                view.decode_idx, view.decode_mask = self._decode_view(reqs, tables, spec, g)
        for req, n in prefills:
            idx, mask = self._prefill_view(req, n, tables[req.request_id], spec, g)
            view.prefill_idx.append(idx)
            view.prefill_mask.append(mask)
        return view

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        p = torch.arange(start, end, device=self.device)
        return table[p // self.block_size] * self.block_size + p % self.block_size

    def _cache_len(self, req: Request, g: int) -> int:
        """Entries group g holds for the request: num_computed_tokens unless eviction dropped some."""
        return self.evictor.cache_len(req, g) if self.evictor is not None else req.num_computed_tokens

    def reads_blocks_in_place(self, g: int) -> bool:
        """True when every layer of group g keeps native K/V, so decodes use `paged_decode`
        (KV eviction observes attention over padded contexts, so it keeps the padded path)."""
        if g not in self._in_place:
            layers = self.kv.groups[g].layers
            self._in_place[g] = all(self.storage.native_kv(layer) is not None for layer in layers)
        return self._in_place[g] and self.evictor is None

    def _paged_decode(self, reqs: list[Request], tables: dict, spec: KVSpec, g: int) -> PagedDecode:
        """Each decode attends over [start, ctx): all of it, or the last `window` tokens."""
        ends = [self._cache_len(r, g) + 1 for r in reqs]
        starts = [max(0, e - spec.window) if spec.kind == "sliding" else 0 for e in ends]
        plan = paged_decode_plan([tables[r.request_id] for r in reqs], starts, ends,
                                 self.block_size, self.blocks_per_chunk)
        pool = self.storage.native_kv(self.kv.groups[g].layers[0])[0]
        plan.workspace = [self._buffer(i, pool, plan.blocks.numel()) for i in range(2)]
        return plan

    def _buffer(self, i: int, pool: torch.Tensor, n: int) -> torch.Tensor:
        """Buffer i shaped [n, *pool.shape[1:]] (grown by doubling, reused across layers and steps)."""
        key = (i, pool.shape[1:], pool.dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((max(n, 2 * (buf.shape[0] if buf is not None else 0)), *pool.shape[1:]),
                              dtype=pool.dtype, device=pool.device)
            self._buffers[key] = buf
        return buf[:n]

    def _decode_view(self, reqs: list[Request], tables: dict, spec: KVSpec, g: int = 0):
        """Each decode attends over [start, ctx): all of it, or the last `window` tokens."""
        ctx = torch.tensor([self._cache_len(r, g) + 1 for r in reqs], device=self.device)
        start = (ctx - spec.window).clamp(min=0) if spec.kind == "sliding" else torch.zeros_like(ctx)
        width = max(len(tables[r.request_id]) for r in reqs)
        table = torch.stack([torch.nn.functional.pad(tables[r.request_id], (0, width - len(tables[r.request_id])))
                             for r in reqs])
        length = int((ctx - start).max())
        p = start[:, None] + torch.arange(length, device=self.device)[None, :]  # [B, L] positions
        p = torch.minimum(p, ctx[:, None] - 1)
        idx = table.gather(1, p // self.block_size) * self.block_size + p % self.block_size
        mask = (start[:, None] + torch.arange(length, device=self.device)[None, :]) < ctx[:, None]
        return idx, mask[:, None, None, :]

    def _prefill_view(self, req: Request, n: int, table: torch.Tensor, spec: KVSpec, g: int = 0):
        """A chunk attends over its cached prefix (trimmed to the window) plus itself."""
        ctx = self._cache_len(req, g) + n
        q0 = ctx - n
        window = spec.window if spec.kind == "sliding" else None
        k0 = max(0, q0 - window + 1) if window else 0
        idx = self._slots(table, k0, ctx)
        if k0 == 0 and q0 == 0 and (window is None or n <= window):
            return idx, None
        q_pos = torch.arange(q0, ctx, device=self.device)
        return idx, window_mask(q_pos, torch.arange(k0, ctx, device=self.device), window)

    def _prompt_logits(self, inp: ModelInput, hidden: torch.Tensor, reqs) -> dict:
        """Logits of rows predicting prompt tokens 1..P-1 (position p predicts token p+1)."""
        out = {}
        row = 0
        for req, n in inp.order:
            if req in reqs:
                start = req.num_computed_tokens
                count = max(0, min(start + n, req.num_prompt_tokens - 1) - start)
                out[req.request_id] = self.model.compute_logits(hidden[row:row + count])
            row += n
        return out

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
