"""Turns a SchedulerOutput into flat tensors, runs the model, returns logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBackends, AttentionMetadata, PrefillSpan, StepBatch
from kvserve.engine.captured_step import CapturedStep
from kvserve.engine.input_batch import InputBatch
from kvserve.engine.request import Request
from kvserve.kv.eviction import KeepAll
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.no_cache import NoCacheManager, NoCacheStorage
from kvserve.kv.storage import KVStorage

log = logging.getLogger("kvserve")


@dataclass
class ModelInput:
    """Flat batch: decodes first, then prefill chunks."""

    input_ids: torch.Tensor            # [num_tokens]
    positions: torch.Tensor            # [num_tokens]
    meta: AttentionMetadata
    order: list[tuple[Request, int]]   # requests in batch order with their new-token counts
    logits_rows: list[int]             # row of the last token of each request that samples (and of
                                       # each of its proposed tokens, speculative decoding)
    sampling_reqs: list[Request]       # requests owning those rows
    step: StepBatch | None = None      # what each group's backend prepared its metadata from
    tables: list[torch.Tensor] | None = None  # per group: block tables [R, W] in batch order


class ModelRunner:
    """Owns the model, the KV storage, one attention backend per KV group (chosen here, once) and the
    captured one-token step; one `execute` per engine step. `eviction` is the KV manager's eviction
    strategy (cache lengths, positions, attention scores): groups whose scores it watches read
    through the gathered path. Over a NoCacheManager (chosen once, here) there are no backends and
    every scheduled request's tokens run as one prefill span (the recompute oracle)."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager | NoCacheManager,
                 storage: KVStorage | NoCacheStorage, device: torch.device, max_num_seqs: int = 64,
                 max_model_len: int = 2048, attention_backend: str = "auto", eviction=None,
                 native_stack: bool = True):
        self.model = model
        self.kv = kv
        self.storage = storage
        self.device = device
        self.block_size = kv.block_size
        self.eviction = eviction or KeepAll()
        self.attn: AttentionBackends | None = None
        self.captured: CapturedStep | None = None   # set while the model runs compiled regions (or the native stack)
        self.native = native_stack   # whether decode steps may run the native decode stack (model/native)
        self._prepare = self._prepare_cached if kv.holds_kv else self._prepare_recompute
        if kv.holds_kv:
            # a table row holds a full-length sequence's blocks and one spare (the table grows if need be)
            self.input_batch = InputBatch(len(kv.groups), max_num_seqs, kv.blocks_for_tokens(max_model_len) + 1,
                                          device)
            self.use_backends(AttentionBackends.select(storage, kv.groups, attention_backend,
                                                       frozenset(self.eviction.observed_groups)))

    def use_backends(self, attn: AttentionBackends) -> None:
        """Attend with `attn` (tests swap in other backends through `set_backends`)."""
        self.attn = attn
        log.info("attention backend per KV group: %s", ", ".join(attn.names(detail=True)))
        self.use_regions(getattr(self.model.model, "regions", None))

    def set_backends(self, backends: list) -> None:
        """Use `backends[g]` for the layers of KV group g."""
        self.use_backends(AttentionBackends(backends, self.attn.layer_group, self.attn.observed))

    def use_regions(self, regions) -> None:
        """The model now runs `regions`: capture the one-token step where they are compiled."""
        self.captured = self.capture(regions)

    def capture(self, regions) -> CapturedStep | None:
        """The captured one-token step over this engine's pools for `regions`, or None."""
        if self.attn is None:
            return None
        return CapturedStep.build(self.model, regions, self.attn, self.storage, self.block_size, self.device,
                                  self.native)

    @property
    def native_stack(self):
        """The native decode stack that runs this runner's decode steps, or None."""
        return None if self.captured is None else self.captured.stack

    @property
    def backends(self) -> list:
        return self.attn.backends if self.attn is not None else []

    def backend_names(self, detail: bool = False) -> list[str]:
        """The backend class of each KV group (see AttentionBackends.names)."""
        return self.attn.names(detail) if self.attn is not None else []

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], prompt_logprob_reqs=()):
        """Run one step; returns (input, logits [len(logits_rows), vocab], prompt logits per request)."""
        inp = self.prepare(scheduled)
        hidden = self.forward(inp)
        logits = self.model.compute_logits(hidden[inp.logits_rows])
        return inp, logits, self._prompt_logits(inp, hidden, prompt_logprob_reqs)

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Run pending copy-on-write block copies, then the model; hidden states [num_tokens, hidden]."""
        self.storage.copy_blocks(self.kv.take_pending_copies())
        return self.model(inp.input_ids, inp.positions, inp.meta)

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        """Build input ids, positions and attention metadata."""
        return self._prepare(scheduled)

    def _prepare_recompute(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        """No cache: no decode rows; each request's tokens are one prefill span over its own rows."""
        order = list(scheduled)
        ids, pos, logits_rows, sampling = self._flatten(order)
        meta = AttentionMetadata(prefills=self._spans(order, 0))
        return ModelInput(self._tensor(ids), self._tensor(pos), meta, order, logits_rows, sampling)

    def _prepare_cached(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        """Decodes first, then prefill chunks; each group's backend builds its metadata. A request
        with proposals (speculative decoding) runs as one decode row per token, row i seeing i more
        cache entries than the first: the rows attend as lone decodes of those tokens would."""
        decodes = [(r, n) for r, n in scheduled if n == 1 or r.spec_token_ids]
        prefills = [(r, n) for r, n in scheduled if n != 1 and not r.spec_token_ids]
        order = decodes + prefills
        ids, pos, logits_rows, sampling = self._flatten(order)
        rows = [(r, 1, i) for r, n in decodes for i in range(n)] + [(r, n, 0) for r, n in prefills]
        spans = self._spans(prefills, len(rows) - len(prefills))
        self.input_batch.release(lambda rid: rid in self.kv.reqs)
        tables = self.input_batch.tables([r.request_id for r, _, _ in rows], self.kv.block_ids)
        step = self._step_batch(rows, len(rows) - len(prefills), len(ids))
        meta = self.attn.metadata(step, tables, spans, self.eviction.score_hook(decodes, prefills))
        if self.captured is not None:
            meta.captured = self.captured.inputs(meta)
        return ModelInput(self._tensor(ids), self._tensor(pos), meta, order, logits_rows, sampling, step, tables)

    def _flatten(self, order: list[tuple[Request, int]]) -> tuple[list[int], list[int], list[int], list[Request]]:
        """Input ids and positions of the new tokens in batch order; the rows that sample and their requests."""
        ids, pos, logits_rows, sampling = [], [], [], []
        for req, n in order:
            start = req.num_computed_tokens
            ids.extend(req.step_tokens(start, n))
            shift = self.eviction.position_shift(req)
            pos.extend(range(start - shift, start - shift + n))
            rows = 1 + len(req.spec_token_ids)   # its last token's row, and one per proposal
            if start + n == req.num_tokens + rows - 1:
                logits_rows.extend(range(len(ids) - rows, len(ids)))
                sampling.append(req)
        return ids, pos, logits_rows, sampling

    @staticmethod
    def _spans(prefills: list[tuple[Request, int]], row: int) -> list[PrefillSpan]:
        """One span per prefill chunk, from batch row `row` on."""
        spans = []
        for req, n in prefills:
            spans.append(PrefillSpan(row, n, req.num_computed_tokens + n))
            row += n
        return spans

    def _step_batch(self, rows: list[tuple[Request, int, int]], num_decodes: int, num_tokens: int) -> StepBatch:
        """`rows`: (request, new tokens, entries its cache holds past num_computed_tokens) in batch order."""
        counts = [n for _, n, _ in rows]
        token_req = torch.arange(len(rows), device=self.device)
        if num_tokens == len(rows):   # a token a row (decodes): each token is its row's first
            token_off = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        else:
            count_t = self._tensor(counts)
            token_req = torch.repeat_interleave(token_req, count_t)
            first = torch.cumsum(count_t, 0) - count_t
            token_off = torch.arange(num_tokens, device=self.device) - first[token_req]
        if self.eviction.uniform:  # every group holds num_computed_tokens: one list for all
            lens = [r.num_computed_tokens + ahead for r, _, ahead in rows]
            cache_lens, cache_len_t = [lens] * len(self.backends), [self._tensor(lens)] * len(self.backends)
        else:   # (speculation, which runs rows ahead, does not run under an evicting kv_policy)
            cache_lens = [[self.eviction.cache_len(r, g) for r, _, _ in rows] for g in range(len(self.backends))]
            cache_len_t = [self._tensor(x) for x in cache_lens]
        return StepBatch(num_decodes, counts, token_req, token_off, cache_lens, cache_len_t)

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

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
