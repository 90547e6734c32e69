"""The captured decode step: a step of decode rows only over native paged K/V (a single token, or 2
to STACK_ROWS rows: a few requests' decodes, a request's token and its speculated tokens) runs the
whole layer stack as one compiled graph that writes and reads the pools itself (model/regions.py's
paged stack), with no Python between the layers. The model runner owns it; each step it is fed a
named CapturedInputs built from the PagedBackends' metadata."""

from __future__ import annotations

import torch

from kvserve.attention import AttentionBackends, AttentionMetadata, CapturedInputs
from kvserve.attention import cpu as cpu_kernel
from kvserve.attention.paged import one_token_blocks, paged_decode_one
from kvserve.kv.storage import KVStorage
from kvserve.model import native as native_stack
from kvserve.model.regions import STACK_ROWS


class CapturedStep:
    """The fixed parts of the captured graphs' inputs: the attention ops (one token; a batch of decode
    rows, or None where the C++ kernel does not read the pools: such steps then run through the
    backends), each distinct pool tensor once, each layer's (K, V) index among them and its KV group."""

    def __init__(self, decode, batch, pools: tuple[torch.Tensor, ...], kv_index: tuple[tuple[int, int], ...],
                 groups: tuple[int, ...], block_size: int, device: torch.device, stack=None):
        self.decode, self.batch, self.pools, self.kv_index, self.groups = decode, batch, pools, kv_index, groups
        self.block_size, self.device = block_size, device
        self.stack = stack   # the native decode stack (model/native), which runs these steps where it is built

    @classmethod
    def build(cls, model: torch.nn.Module, regions, attn: AttentionBackends, storage: KVStorage,
              block_size: int, device: torch.device, native: bool = True) -> CapturedStep | None:
        """The step when every KV group keeps native K/V read by PagedBackend and the model runs
        `regions` compiled, or its layers run as the native decode stack (model/native: the C++
        attention kernel reading every pool, and layers it runs; compiled or not); None otherwise
        (decode rows then run through the backends). `native=False`: no native stack."""
        layers = getattr(model.model, "layers", ())
        if (not attn.paged or sorted(attn.layer_group) != list(range(len(layers)))
                or not all(hasattr(layer.self_attn, "scale") for layer in layers)):
            return None
        pools, kv_index = distinct_pools([storage.native_kv(i) for i in range(len(layers))])
        groups = tuple(attn.layer_group[i] for i in range(len(layers)))
        # the C++ kernel where it reads every pool (an opaque op in the graph), else torch's ops
        kernel = all(b.kernel for b in attn.backends)
        stack = native_stack.build(model, pools, kv_index, groups, STACK_ROWS) if kernel and native else None
        if stack is None and not getattr(regions, "compiled", False):
            return None
        decode = cpu_kernel.paged_decode_one if kernel else paged_decode_one
        batch = cpu_kernel.paged_decode_batch if kernel else None
        return cls(decode, batch, pools, kv_index, groups, block_size, device, stack)

    def inputs(self, meta: AttentionMetadata) -> CapturedInputs | None:
        """This step's inputs when it has decode rows only, one (per group: the token's slot, the visible
        blocks, of an unbacked length: one graph for every context length, and the visible positions
        among them) or up to STACK_ROWS (per group: the rows' slots, block tables of an unbacked width
        and visible positions); None for any other step."""
        rows = meta.num_decodes
        if meta.prefills or rows == 0 or rows > STACK_ROWS:
            return None
        mark = self.stack is None   # only graphs need the unbacked sizes (marking imports torch._dynamo)
        if rows == 1:
            views = [one_token_blocks(md.decode.tables[0], int(md.decode.start), int(md.decode.end), self.block_size,
                                      mark) for md in meta.groups]
            return self._with(self.decode, tuple(md.slot_mapping for md in meta.groups), views, self.pools)
        if self.batch is None:
            return None
        views = [batch_tables(md.decode.tables, md.decode.start, md.decode.end, mark) for md in meta.groups]
        return self._with(self.batch, tuple(md.slot_mapping for md in meta.groups), views, self.pools)

    def warm_up_inputs(self, rows: int = 1) -> CapturedInputs | None:
        """Inputs for a fake decode of `rows` rows at slot 0 over pools shaped like the engine's but not
        theirs (empty ones: the engine may be writing its own meanwhile, and pages never touched cost
        no memory), for compiling a graph before a request's first decode step; None for rows the
        step does not capture."""
        if rows > 1 and self.batch is None:
            return None
        scratch = tuple(_empty_like(p) for p in self.pools)
        with torch.inference_mode():   # as a step's slots, blocks and spans are (the guards tell them apart)
            # each group's its own, as in a step (the graph guards on which inputs are one tensor)
            slots = tuple(torch.zeros(rows, dtype=torch.long, device=self.device) for _ in range(max(self.groups) + 1))
            if rows == 1:
                views = [one_token_blocks(slot, 0, 1, self.block_size) for slot in slots]
            else:
                views = [batch_tables(torch.zeros(rows, 1, dtype=torch.long, device=self.device), slot, slot + 1)
                         for slot in slots]
        return self._with(self.decode if rows == 1 else self.batch, slots, views, scratch, stack=None)

    def _with(self, decode, slots, views, pools, stack=True) -> CapturedInputs:
        """The step's inputs; `stack=None`: for the graphs (a warm-up's scratch pools are not the stack's)."""
        return CapturedInputs(decode, pools, self.kv_index, slots, tuple(b for b, _ in views),
                              tuple(span for _, span in views), self.groups, self.stack if stack else None)


def batch_tables(tables: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                 mark: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_decode_batch's (tables, ranges) for decode rows attending over [starts[i], ends[i]) of
    their block tables [R, W]: the tables in storage of their own, the width marked unbacked (one
    graph for every context length, as one_token_blocks; not with `mark` False: the native stack),
    and the ranges as one [2, R] tensor."""
    own = tables.clone(memory_format=torch.contiguous_format)
    if mark:
        torch._dynamo.decorators.mark_unbacked(own, 1)
    return own, torch.stack((starts, ends))


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
