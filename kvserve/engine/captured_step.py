"""The captured one-token step: a single decode token over native paged K/V runs the whole layer
stack as one compiled graph that writes and reads the pools itself (model/regions.py's one-token
paged stack), with no Python between the layers. The model runner owns it; each step it is fed a
named OneTokenInputs built from the PagedBackends' metadata."""

from __future__ import annotations

import torch

from kvserve.attention import AttentionBackends, AttentionMetadata, OneTokenInputs
from kvserve.attention import cpu as cpu_kernel
from kvserve.attention.paged import one_token_blocks, paged_decode_one
from kvserve.kv.storage import KVStorage


class CapturedStep:
    """The fixed parts of the one-token graph's inputs: the attention op, each distinct pool tensor
    once, each layer's (K, V) index among them and its KV group."""

    def __init__(self, decode, pools: tuple[torch.Tensor, ...], kv_index: tuple[tuple[int, int], ...],
                 groups: tuple[int, ...], block_size: int, device: torch.device):
        self.decode, self.pools, self.kv_index, self.groups = decode, pools, kv_index, groups
        self.block_size, self.device = block_size, device

    @classmethod
    def build(cls, model: torch.nn.Module, regions, attn: AttentionBackends, storage: KVStorage,
              block_size: int, device: torch.device) -> CapturedStep | None:
        """The step when the model runs `regions` compiled and every KV group keeps native K/V read by
        PagedBackend; None otherwise (single tokens then run through the backends)."""
        layers = getattr(model.model, "layers", ())
        if (not getattr(regions, "compiled", False) or not attn.paged
                or sorted(attn.layer_group) != list(range(len(layers)))
                or not all(hasattr(layer.self_attn, "scale") for layer in layers)):
            return None
        pools, kv_index = distinct_pools([storage.native_kv(i) for i in range(len(layers))])
        # the C++ kernel where it reads every pool (an opaque op in the graph), else torch's ops
        decode = cpu_kernel.paged_decode_one if all(b.kernel for b in attn.backends) else paged_decode_one
        return cls(decode, pools, kv_index, tuple(attn.layer_group[i] for i in range(len(layers))), block_size,
                   device)

    def inputs(self, meta: AttentionMetadata) -> OneTokenInputs | None:
        """This step's inputs when it is a single decode token: per group, the token's slot, the visible
        blocks (of an unbacked length: one graph for every context length) and the visible positions
        among them. None for any other step."""
        if meta.num_decodes != 1 or meta.prefills:
            return None
        views = [one_token_blocks(md.decode.tables[0], int(md.decode.start), int(md.decode.end), self.block_size)
                 for md in meta.groups]
        return self._with(tuple(md.slot_mapping for md in meta.groups), views, self.pools)

    def warm_up_inputs(self) -> OneTokenInputs:
        """Inputs for a fake decode at slot 0 over pools shaped like the engine's but not theirs (empty
        ones: the engine may be writing its own meanwhile, and pages never touched cost no memory), for
        compiling the graph before a request's first decode step."""
        scratch = tuple(_empty_like(p) for p in self.pools)
        with torch.inference_mode():   # as a step's slot, blocks and span are (the guards tell them apart)
            # each group's its own, as in a step (the graph guards on which inputs are one tensor)
            slots = tuple(torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(max(self.groups) + 1))
            views = [one_token_blocks(slot, 0, 1, self.block_size) for slot in slots]
        return self._with(slots, views, scratch)

    def _with(self, slots, views, pools) -> OneTokenInputs:
        return OneTokenInputs(self.decode, pools, self.kv_index, slots, tuple(b for b, _ in views),
                              tuple(span for _, span in views), self.groups)


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
