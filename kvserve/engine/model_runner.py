"""Turns a SchedulerOutput into flat tensors, runs the model, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.request import Request
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage
from kvserve.model.attention import AttentionMetadata, PrefillSpan


@dataclass
class ModelInput:
    """Flat batch: decodes first, then prefill chunks."""

    input_ids: torch.Tensor        # [num_tokens]
    positions: torch.Tensor        # [num_tokens]
    meta: AttentionMetadata
    order: list[tuple[Request, int]]   # requests in batch order with their new-token counts
    logits_rows: list[int]         # row of the last token of each request that samples this step
    sampling_reqs: list[Request]   # requests owning those rows


class ModelRunner:
    """Owns the model and the KV storage; one `execute` per engine step."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager | None, storage: KVStorage | None,
                 device: torch.device):
        self.model = model
        self.kv = kv
        self.storage = storage
        self.device = device
        self.block_size = kv.block_size if kv is not None else 1

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], prompt_logprob_reqs=()) -> tuple[ModelInput, torch.Tensor, dict]:
        """Run one step; returns the input, logits [len(sampling_reqs), vocab], prompt logits per request."""
        if self.kv is not None:
            self.storage.copy_blocks(self.kv.take_pending_copies())
        inp = self.prepare(scheduled)
        hidden = self.model(inp.input_ids, inp.positions, self.storage, inp.meta)
        logits = self.model.compute_logits(hidden[inp.logits_rows])
        prompt_logits = self._prompt_logits(inp, hidden, prompt_logprob_reqs)
        return inp, logits, prompt_logits

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        """Build input ids, positions, slot mapping and attention metadata."""
        cached = self.kv is not None
        decodes = [(r, n) for r, n in scheduled if n == 1 and cached]
        prefills = [(r, n) for r, n in scheduled if not (n == 1 and cached)]
        order = decodes + prefills
        ids, pos, slots, spans, logits_rows, sampling = [], [], [], [], [], []
        row = 0
        for req, n in order:
            start = req.num_computed_tokens
            ids.extend(req.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            if cached:
                slots.extend(self._slots(req, start, start + n))
            if start + n == req.num_tokens:
                logits_rows.append(row + n - 1)
                sampling.append(req)
            row += n
        meta = AttentionMetadata(slot_mapping=self._tensor(slots) if cached else None)
        if decodes:
            self._decode_meta(meta, [r for r, _ in decodes])
        row = len(decodes)
        for req, n in prefills:
            meta.prefills.append(self._prefill_span(req, n, row, cached))
            row += n
        return ModelInput(self._tensor(ids), self._tensor(pos), meta, order, logits_rows, sampling)

    def _slots(self, req: Request, start: int, end: int) -> list[int]:
        table = self.kv.block_ids(req.request_id)
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _decode_meta(self, meta: AttentionMetadata, reqs: list[Request]) -> None:
        ctx = torch.tensor([r.num_computed_tokens + 1 for r in reqs], device=self.device)
        tables = [self.kv.block_ids(r.request_id) for r in reqs]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)
        max_len = int(ctx.max())
        p = torch.arange(max_len, device=self.device)
        meta.num_decodes = len(reqs)
        meta.decode_slot_idx = table[:, p // self.block_size] * self.block_size + p % self.block_size
        meta.decode_mask = (p[None, :] < ctx[:, None])[:, None, None, :]

    def _prefill_span(self, req: Request, n: int, row: int, cached: bool) -> PrefillSpan:
        ctx = req.num_computed_tokens + n
        span = PrefillSpan(start=row, num_tokens=n, context_len=ctx)
        if cached:
            span.slot_idx = self._tensor(self._slots(req, 0, ctx))
            if ctx > n:  # a cached prefix: new token i sits at position ctx - n + i
                q_pos = torch.arange(ctx - n, ctx, device=self.device)
                span.mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos[:, None]
        return span

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
