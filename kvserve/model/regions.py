"""How a decoder stack runs: attention through its backend, and the dense work between two
attention calls (output projection, residuals, norms, MLP, the next layer's norm, Q/K/V projection
and rotary embedding) as one region, run eagerly or compiled.

Compiled, a step of up to STACK_ROWS tokens (a decode of a few requests, or one request verifying
its speculated tokens) runs the whole stack as one `torch.compile` graph: one graph call per step
instead of one per layer, which is most of the host time of a small model's step. Decode rows over
native paged K/V run the paged stack, whose attention ops write and read the pools themselves
(engine/captured_step.py feeds it); other steps run the stack with an opaque attention op
(`stack_attend_op`, one per compiled Regions: the backend reads and writes the cache eagerly, with
the step's metadata). One token has static graphs of their own; 2..STACK_ROWS tokens share ones
with a dynamic row count. Steps of more tokens run
per region: every region of a model is one graph shared by all its layers (the layer's weights
are graph inputs, not constants) with dynamic shapes, compiled in seconds; at those sizes the
arithmetic outweighs the calls.
"""

from __future__ import annotations

import copy
import itertools
import logging

import torch
from tqdm.auto import tqdm

from kvserve.model import quant
from kvserve.model.graph_code import private_copy

log = logging.getLogger("kvserve")

# Row counts at which model/quant.py switches kernels (a step of more rows than a bound runs another
# one): each range between two bounds is a graph of its own in every region.
ROW_BOUNDS = sorted({*quant.GEMV_ROWS.values(), quant.COPY_ROWS, quant.SMALL_ROWS,
                     quant.HALF_WIDE_ROWS, quant.TIED_WIDE_ROWS, quant.TILE_ROWS})
# Steps of up to this many tokens run the whole stack as one graph (the rows of a speculating
# request's verification, a few requests' decodes).
STACK_ROWS = 8
# Token counts a warm-up runs: one token (the one-token stack graph), then the top of each of those
# ranges and one past the last, so that no step of any size compiles a graph after the warm-up.
WARMUP_TOKENS = tuple(sorted({1, *ROW_BOUNDS, ROW_BOUNDS[-1] + 1}))
# Graphs kept per region across every engine of the process (torch's default is 8).
RECOMPILE_LIMIT = 64


def _first(layer, x, positions):
    return layer.pre_attention(x, positions)


def _between(layer, following, x, o, positions):
    x = layer.post_attention(x, o)
    return x, following.pre_attention(x, positions)


def _last(layer, x, o):
    return layer.post_attention(x, o)


class StepSlot:
    """The layers and metadata of the one-token stack graph running now, for its attention op."""

    def __init__(self):
        self.layers = None
        self.meta = None


_OP_NUMBERS = itertools.count()   # each compiled Regions registers its own attention op


def stack_attend_op(step: StepSlot):
    """A custom op for the one-token graph: layer `layer`'s attention (cache write and read, run
    eagerly) with the layers and metadata `step` holds while the graph runs. One op per Regions: an
    op's arguments cannot carry Python objects, so each reads its own slot."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return step.layers[layer].self_attn.attend(q, k, v, step.meta)

    op = torch.library.custom_op(f"kvserve::stack_attend_{next(_OP_NUMBERS)}", attend, mutates_args=())
    op.register_fake(lambda q, k, v, layer: q.new_empty((*q.shape[:2], v.shape[-1])))
    return op


def _one_token_stack(layers, x, positions, attend):
    """The whole stack for one token, attention by the opaque op `attend` (compiled as one graph)."""
    q, k, v = _first(layers[0], x, positions)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        o = attend(q, k, v, i)
        if i == last:
            return _last(layer, x, o)
        x, (q, k, v) = _between(layer, layers[i + 1], x, o, positions)
    return x


def _paged_stack(layers, x, positions, decode, pools, kv_index, slots, blocks, spans, groups):
    """The whole stack for a step of decode rows over native paged K/V, the cache written and read
    in the graph by `decode` (one token: attention/paged.py paged_decode_one or the C++ kernel's;
    2 to STACK_ROWS rows: the C++ kernel's paged_decode_batch; opaque ops): no Python between the
    layers. `pools` holds each pool tensor once and layer i reads pools[kv_index[i][0]] (K) and
    pools[kv_index[i][1]] (V): KV groups share pool slots, and a tensor passed twice would be two
    aliased mutated inputs, which the graph copies whole instead of writing in place."""
    q, k, v = _first(layers[0], x, positions)
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        g, (ki, vi) = groups[i], kv_index[i]
        o = decode(q, k, v, pools[ki], pools[vi], slots[g], blocks[g], spans[g], layer.self_attn.scale)
        if i == last:
            return _last(layer, x, o)
        x, (q, k, v) = _between(layer, layers[i + 1], x, o, positions)
    return x


class Regions:
    """The dense regions of a decoder stack; `compiled` wraps each with torch.compile, and adds the
    one-token stack graph."""

    def __init__(self, compiled: bool = False, stacks: bool = True):
        """`stacks=False`: the regions only, no stack graphs (the native decode stack runs decode steps)."""
        self.compiled = compiled
        wrap = (lambda f: _compile(private_copy(f))) if compiled else (lambda f: f)
        self.first, self.between, self.last = wrap(_first), wrap(_between), wrap(_last)
        stacked = compiled and stacks
        self.one_token = _compile_static(_one_token_stack) if stacked else None
        self.one_token_paged = _compile_static(_paged_stack) if stacked else None
        self.few_tokens = _compile_stack(_one_token_stack) if stacked else None
        self.few_paged = _compile_stack(_paged_stack, wrapper=True) if stacked else None
        self.step = StepSlot()   # what the stack graphs' attention op reads
        self.attend = stack_attend_op(self.step) if stacked else None

    def run(self, layers, x: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """x through every layer: layer i's attention, then the region up to layer i + 1's."""
        if meta.captured is not None and meta.captured.stack is not None:   # model/native
            return meta.captured.stack(layers, x, positions, meta.captured)
        if self.one_token is not None and x.shape[0] <= STACK_ROWS:
            if meta.captured is not None:
                return self._paged(layers, x, positions, meta.captured)
            return self._stack(self.few_tokens if x.shape[0] > 1 else self.one_token, layers, x, positions, meta)
        q, k, v = self.first(layers[0], x, positions)
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            o = layer.self_attn.attend(q, k, v, meta)
            if i == last:
                return self.last(layer, x, o)
            x, (q, k, v) = self.between(layer, layers[i + 1], x, o, positions)
        return x

    def _stack(self, graph, layers, x, positions, meta):
        step = self.step
        step.layers, step.meta = layers, meta
        try:
            return graph(layers, x, positions, self.attend)
        finally:
            step.layers = step.meta = None

    def _paged(self, layers, x, positions, inputs):
        rows = x.shape[0]
        for layer in layers:
            vars(layer.self_attn)["kv_rows"] += rows   # an int in the module's dict (nn.Module.__setattr__ costs 8 us)
        graph = self.one_token_paged if rows == 1 else self.few_paged
        return graph(layers, x, positions, *inputs.args())   # engine/captured_step.py


EAGER = Regions(False)


def _compile_static(fn):
    """One static graph; guards on the modules skipped (a Regions' layers never change: the dynamo
    cache lookup was 1.3 ms of a one-token call), no size asserts on its hundreds of inputs (0.7 ms
    a call), and a C++ wrapper (its kernels and ops called from compiled C++, not one Python call
    each: the wrapper's own time per decode step fell by about 1.2 ms), built apart from the kernels
    at -O1 (one -O3 build of both took minutes)."""
    return torch.compile(private_copy(fn), dynamic=False, fullgraph=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                  "size_asserts": False, "cpp_wrapper": True,
                                  "cpp_wrapper_build_separate": True})


def _compile_stack(fn, wrapper: bool = False):
    """The stack graph for 2..STACK_ROWS tokens: the row count dynamic (one graph per range of rows
    that picks the same kernels), the module guards skipped as in _compile_static; with `wrapper`,
    no size asserts and a C++ wrapper as there too."""
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if wrapper:
        options.update({"size_asserts": False, "cpp_wrapper": True, "cpp_wrapper_build_separate": True})
    return torch.compile(private_copy(fn), dynamic=True, fullgraph=True, options=options)


def _compile(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


def supports_regions(model: torch.nn.Module) -> bool:
    """True when every layer splits into pre_attention / attend / post_attention."""
    layers = getattr(model.model, "layers", ())
    return bool(layers) and all(hasattr(layer, "pre_attention") and hasattr(layer, "post_attention")
                                for layer in layers)


def compiled_regions(model: torch.nn.Module, stacks: bool = True) -> Regions | None:
    """A compiled Regions for `model` (not installed yet: `model.model.regions` stays as it is), with
    the stack graphs unless `stacks` is False, or None when its layers have no regions."""
    if not supports_regions(model):
        log.info("compiled regions: %s runs eagerly (its layers have no dense regions)", type(model).__name__)
        return None
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # A module's floats (a norm's eps, attention's scale) are constants: traced as symbolic floats, the
    # few-row paged graph's op arguments could not become tensors and dynamo traced it all again.
    torch._dynamo.config.specialize_float = True
    return Regions(True, stacks)


def shadow_layers(layers) -> torch.nn.ModuleList:
    """Copies of `layers` sharing every weight, each with an attention module of its own: a warm-up
    through them leaves the live layers' K/V row counters alone while the engine runs them."""
    def shadow(layer):
        copy_ = copy.copy(layer)
        copy_.__dict__["_modules"] = {**layer._modules, "self_attn": copy.copy(layer.self_attn)}
        return copy_
    return torch.nn.ModuleList(shadow(layer) for layer in layers)


@torch.inference_mode()
def warm_up(regions: Regions, model: torch.nn.Module, device: torch.device, captured=None,
            show_progress: bool = True) -> None:
    """Compile each of `regions`' graphs now (forwards without a cache through shadow layers), not on a
    request's first step; with `captured` (the runner's CapturedStep, whose warm_up_inputs are pools
    shaped like the engine's, not the engine's) the paged graphs too. The live model is only read."""
    from kvserve.attention import AttentionMetadata, PrefillSpan
    layers = shadow_layers(model.model.layers)
    for n in tqdm(WARMUP_TOKENS, desc="compiling the model's regions", disable=not show_progress, unit="shape"):
        meta = AttentionMetadata(prefills=[PrefillSpan(0, n, n)])
        regions.run(layers, _hidden(model, n, device), torch.arange(n, device=device), meta)
    for rows in (1, STACK_ROWS) if captured is not None and regions.one_token_paged is not None else ():
        inputs = captured.warm_up_inputs(rows)
        if inputs is not None:
            meta = AttentionMetadata(num_decodes=rows, captured=inputs)
            regions.run(layers, _hidden(model, rows, device), torch.zeros(rows, dtype=torch.long, device=device), meta)


def _hidden(model: torch.nn.Module, n: int, device: torch.device) -> torch.Tensor:
    """Hidden states [n, hidden] in the model's dtype (values do not matter for a warm-up)."""
    return model.model.embed_tokens(torch.zeros(n, dtype=torch.long, device=device))
