"""Turns a SchedulerOutput into flat tensors, runs the model, returns logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.attention import (
    AttentionMetadata,
    PagedBackend,
    PrefillSpan,
    StepBatch,
    select_backend,
)
from kvserve.attention import cpu as cpu_kernel
from kvserve.attention.paged import one_token_blocks, paged_decode_one
from kvserve.engine.input_batch import InputBatch
from kvserve.engine.request import Request
from kvserve.kv.eviction import KeepAll
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage

log = logging.getLogger("kvserve")


@dataclass
class ModelInput:
    """Flat batch: decodes first, then prefill chunks."""

    input_ids: torch.Tensor            # [num_tokens]
    positions: torch.Tensor            # [num_tokens]
    meta: AttentionMetadata
    order: list[tuple[Request, int]]   # requests in batch order with their new-token counts
    logits_rows: list[int]             # row of the last token of each request that samples
    sampling_reqs: list[Request]       # requests owning those rows
    step: StepBatch | None = None      # what each group's backend prepared its metadata from
    tables: list[torch.Tensor] | None = None  # per group: block tables [R, W] in batch order


class ModelRunner:
    """Owns the model, the KV storage and one attention backend per KV group (chosen here, once);
    one `execute` per engine step."""

    def __init__(self, model: torch.nn.Module, kv: KVCacheManager | None, storage: KVStorage | None,
                 device: torch.device, max_num_seqs: int = 64, max_model_len: int = 2048,
                 attention_backend: str = "auto"):
        self.model = model
        self.attention_backend = attention_backend  # select_backend's kind: auto, torch, triton
        self.kv = kv
        self.storage = storage
        self.device = device
        self.block_size = kv.block_size if kv is not None else 1
        self.eviction = KeepAll()  # the KV manager's eviction strategy: cache lengths, positions, scores
        self.backends: list = []
        self.layer_backend: dict[int, object] = {}
        self.layer_group: dict[int, int] = {}
        self.native_pools = None   # (decode op, pools, (K, V) pool index per layer, group per layer): see one_token_plan
        self._backends_said = ""   # the backends last logged
        if kv is not None:
            self.input_batch = InputBatch(len(kv.groups), max_num_seqs, -(-max_model_len // self.block_size) + 1,
                                          device)
            self.layer_group = dict(storage.layer_group)
            self.use_eviction(kv.eviction)

    def use_eviction(self, eviction) -> None:
        """Use the eviction strategy and choose each group's backend: groups whose attention scores
        it watches read through the gathered path."""
        self.eviction = eviction
        if self.kv is None:
            return
        observed = eviction.observed_groups
        self.set_backends([select_backend(self.storage, group, g in observed, self.attention_backend)
                          for g, group in enumerate(self.kv.groups)])

    def set_backends(self, backends: list) -> None:
        """Use `backends[g]` for the layers of KV group g."""
        self.backends = backends
        self.layer_backend = {layer: backends[g] for layer, g in self.layer_group.items()}
        said = ", ".join(self.backend_names(detail=True))
        if said != self._backends_said:   # once, and again when it changes
            log.info("attention backend per KV group: %s", said)
            self._backends_said = said
        self.native_pools = self.native_pools_for(getattr(self.model.model, "regions", None))

    def native_pools_for(self, regions):
        """(The one-token attention, the distinct pool tensors, each layer's (K, V) index among them,
        the layer's group) when the model runs `regions` compiled and every group keeps native K/V read
        by PagedBackend: a single decode token then runs as one graph that writes and reads the pools
        itself (model/regions.py). None otherwise."""
        layers = getattr(self.model.model, "layers", ())
        if (not getattr(regions, "compiled", False) or not all(type(b) is PagedBackend for b in self.backends)
                or sorted(self.layer_group) != list(range(len(layers)))
                or not all(hasattr(layer.self_attn, "scale") for layer in layers)):
            return None
        pools, kv_index = distinct_pools([self.storage.native_kv(i) for i in range(len(layers))])
        # the C++ kernel where it reads every pool (an opaque op in the graph), else torch's ops
        decode = cpu_kernel.paged_decode_one if all(b.kernel for b in self.backends) else paged_decode_one
        return decode, pools, kv_index, tuple(self.layer_group[i] for i in range(len(layers)))

    def one_token_plan(self, meta: AttentionMetadata) -> tuple | None:
        """The one-token graph's inputs for a step of a single decode token (see native_pools_for):
        per group, the visible blocks (of an unbacked length: one graph for every context length)
        and the visible positions among them."""
        if self.native_pools is None or meta.num_decodes != 1 or meta.prefills or meta.score_hook is not None:
            return None
        decode, pools, kv_index, groups = self.native_pools
        views = [one_token_blocks(table[0], int(start), int(end), self.block_size)
                 for table, start, end in (md.decode_range for md in meta.groups)]
        return (decode, pools, kv_index, tuple(md.slot_mapping for md in meta.groups), tuple(b for b, _ in views),
                tuple(span for _, span in views), groups)

    def warm_up_plan(self, native_pools) -> tuple:
        """One-token graph inputs for a fake decode at slot 0 over pools shaped like `native_pools`' but
        not theirs (empty ones: the engine may be writing its own meanwhile, and pages never touched
        cost no memory), for compiling that graph before a request's first decode step."""
        decode, pools, kv_index, groups = native_pools
        scratch = tuple(_empty_like(p) for p in pools)
        with torch.inference_mode():   # as a step's slot, blocks and span are (the guards tell them apart)
            # each group's its own, as in a step (the graph guards on which inputs are one tensor)
            slots = tuple(torch.zeros(1, dtype=torch.long, device=self.device) for _ in self.backends)
            views = [one_token_blocks(slot, 0, 1, self.block_size) for slot in slots]
        return (decode, scratch, kv_index, slots, tuple(b for b, _ in views), tuple(span for _, span in views),
                groups)

    def backend_names(self, detail: bool = False) -> list[str]:
        """The backend class of each KV group (for logs and tests); with `detail`, how PagedBackend
        decodes (the C++ CPU kernel or torch's ops)."""
        names = [type(b).__name__ for b in self.backends]
        if detail:
            names = [f"{n} ({'CPU kernel' if b.kernel else 'torch ops'})" if isinstance(b, PagedBackend) else n
                     for n, b in zip(names, self.backends)]
        return names

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], prompt_logprob_reqs=()):
        """Run one step; returns (input, logits [len(sampling_reqs), vocab], prompt logits per request)."""
        inp = self.prepare(scheduled)
        hidden = self.forward(inp)
        logits = self.model.compute_logits(hidden[inp.logits_rows])
        return inp, logits, self._prompt_logits(inp, hidden, prompt_logprob_reqs)

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Run pending copy-on-write block copies, then the model; hidden states [num_tokens, hidden]."""
        if self.kv is not None:
            self.storage.copy_blocks(self.kv.take_pending_copies())
        return self.model(inp.input_ids, inp.positions, inp.meta)

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
            shift = self.eviction.position_shift(req)
            pos.extend(range(start - shift, start - shift + n))
            if start + n == req.num_tokens:
                logits_rows.append(len(ids) - 1)
                sampling.append(req)
        meta = AttentionMetadata(num_decodes=len(decodes))
        row = len(decodes)
        for req, n in prefills:
            meta.prefills.append(PrefillSpan(row, n, req.num_computed_tokens + n))
            row += n
        inp = ModelInput(self._tensor(ids), self._tensor(pos), meta, order, logits_rows, sampling)
        if cached:
            inp.step, inp.tables = self._cache_metadata(meta, order, len(decodes), len(ids))
            meta.score_hook = self.eviction.score_hook(decodes, prefills)
            meta.one_token = self.one_token_plan(meta)
        return inp

    def _cache_metadata(self, meta: AttentionMetadata, order, num_decodes: int, num_tokens: int):
        """Each group's metadata from its backend, over the persistent block tables; returns the step
        batch and tables it was built from."""
        self.input_batch.release(lambda rid: rid in self.kv.reqs)
        tables = self.input_batch.tables([r.request_id for r, _ in order], self.kv.block_ids)
        step = self._step_batch(order, num_decodes, num_tokens)
        meta.groups = [b.prepare(step, g, tables[g]) for g, b in enumerate(self.backends)]
        meta.backend_of = self.layer_backend.__getitem__
        meta.layer_group = self.layer_group
        return step, tables

    def _step_batch(self, order, num_decodes: int, num_tokens: int) -> StepBatch:
        counts = [n for _, n in order]
        req_idx = self._tensor(range(len(order)))
        count_t = self._tensor(counts)
        token_req = torch.repeat_interleave(req_idx, count_t)
        first = torch.cumsum(count_t, 0) - count_t
        token_off = torch.arange(num_tokens, device=self.device) - first[token_req]
        if self.eviction.uniform:  # every group holds num_computed_tokens: one list for all
            lens = [r.num_computed_tokens for r, _ in order]
            cache_lens, cache_len_t = [lens] * len(self.backends), [self._tensor(lens)] * len(self.backends)
        else:
            cache_lens = [[self.eviction.cache_len(r, g) for r, _ in order] for g in range(len(self.backends))]
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


def distinct_pools(per_layer) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[int, int], ...]]:
    """(Each distinct tensor of `per_layer` [(K pool, V pool)] once, in first-seen order; each layer's
    (K, V) index among them): layers of different KV groups share a slot's pools."""
    pools, index = [], {}
    for kv in per_layer:
        for t in kv:
            if id(t) not in index:
                index[id(t)] = len(pools)
                pools.append(t)
    return tuple(pools), tuple((index[id(k)], index[id(v)]) for k, v in per_layer)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like `t`, an inference tensor only where `t` is one (the graph's guards tell them apart)."""
    with torch.inference_mode(t.is_inference()):
        return torch.empty_like(t)
