"""A decode step's decoder stack as one C++ call (stack.cpp), for Llama-family models on the CPU.

A step of 1 to STACK_ROWS decode rows over native paged K/V otherwise runs the stack as a compiled
graph: about 150 ops a step, each a boxed dispatcher call from the graph's wrapper, with fused
element-wise kernels between them. `kvserve_stack.Stack` runs the same layers with the same kernels
(kvserve_cpu's GEMVs for every projection, kvserve_attn's decode ops for the cache write and the
attention) and does the element-wise work (RMSNorm, rotary embedding, residuals, the SiLU product)
itself, with no Python, no graph and no compile. `build` describes a model to it once; it returns
None where a layer is not one it runs (another architecture, q/k norms, a projection whose few-row
kernel is not one of kvserve's GEMVs, non-float32 activations), and the graphs serve that model.
Compiled like the other kernels (kvserve/native.py); `available()` is False where the build fails.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve import native

SOURCE = Path(__file__).with_name("stack.cpp")
PROJECTIONS = ("qkv", "o", "gate_up", "down")

_state: dict = {}


def available() -> bool:
    """True once the stack's class is loaded, with the GEMV and attention ops it calls (built on the
    first call; False, logged once, where one cannot be)."""
    from kvserve.attention import cpu as attention_cpu
    from kvserve.model import cpu as gemv_cpu
    return (gemv_cpu.available() and attention_cpu.kernel()
            and native.load_ops(_state, SOURCE, "native decode stack unavailable (%s); decode steps run the "
                                "compiled graphs"))


class NativeStack:
    """The C++ stack of one engine (its model, its pools): called with the step's decode rows."""

    def __init__(self, stack, rope):
        self.stack, self.rope = stack, rope

    def __call__(self, layers, x: torch.Tensor, positions: torch.Tensor, inputs) -> torch.Tensor:
        rows = x.shape[0]
        for layer in layers:
            vars(layer.self_attn)["kv_rows"] += rows   # as the graphs count (model/regions.py)
        return self.stack.run(x, positions, self.rope.cos, self.rope.sin, list(inputs.slots), list(inputs.blocks),
                              list(inputs.spans))


def build(model: torch.nn.Module, pools, kv_index, groups, max_rows: int) -> NativeStack | None:
    """The native stack for `model`'s layers over `pools` (layer i's K and V at kv_index[i], its KV group
    groups[i]) serving steps of 1..max_rows decode rows, or None where it cannot run them."""
    layers = getattr(model.model, "layers", ())
    if not layers or not all(_plain_llama(layer) for layer in layers) or not available():
        return None
    forms = [_projections(layer, max_rows) for layer in layers]
    if any(f is None for f in forms) or any(p.device.type != "cpu" or p.dtype != torch.float32
                                            for layer in layers for p in layer.parameters()):
        return None
    attn, mlp = layers[0].self_attn, layers[0].mlp
    rope = attn.rope
    if rope.cos.dtype != torch.float32:
        return None
    hidden = layers[0].input_layernorm.weight.numel()
    stack = torch.classes.kvserve_stack.Stack(attn.num_heads, attn.num_kv_heads, attn.head_dim, hidden,
                                               mlp.gate_up.sizes[0], list(pools))
    for layer, form, (k, v), group in zip(layers, forms, kv_index, groups):
        a = layer.self_attn
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        layer.input_layernorm.eps, a.scale, k, v, group)
        for which, linears in zip(PROJECTIONS, form):
            for kind, tensors, group_size, bias in linears:
                stack.add_linear(which, kind, *tensors, group_size, bias)
    return NativeStack(stack, rope)


def _plain_llama(layer) -> bool:
    """A Llama decoder layer the C++ stack runs: RMSNorms, half-split rotary embedding, SwiGLU, no
    q/k norms, the norms' epsilon shared."""
    from kvserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
    from kvserve.model.llama import LlamaAttention, LlamaDecoderLayer
    a = getattr(layer, "self_attn", None)
    return (type(layer) is LlamaDecoderLayer and type(a) is LlamaAttention and type(layer.mlp) is GatedMLP
            and type(a.rope) is RotaryEmbedding and not hasattr(a, "q_norm")
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps)


def _projections(layer, max_rows: int):
    """Each projection's linears as (kind, (a, b, c), group, bias) for Stack.add_linear, or None where
    one runs a kernel the stack does not call."""
    from kvserve.model.quant import KeptLinear
    a, mlp = layer.self_attn, layer.mlp
    out = []
    for members in (_members(a.qkv), [a.o_proj], _members(mlp.gate_up), [mlp.down_proj]):
        if not all(isinstance(m, KeptLinear) for m in members):
            return None
        forms = [m.native_form(max_rows) for m in members]
        if any(f is None for f in forms):
            return None
        out.append([(kind, tensors, group, m.bias) for (kind, tensors, group), m in zip(forms, members)])
    return out


def _members(fused) -> list:
    """The layers a fused group runs: its one quantized layer, or its members."""
    return [fused.quant] if fused.quant is not None else list(fused.linears)
