"""A decode step's decoder stack as one C++ call (stack.cpp), for Llama-family and Gemma 3 models on
the CPU.

A step of 1 to STACK_ROWS decode rows over native paged K/V otherwise runs the stack as a compiled
graph: about 150 ops a step, each a boxed dispatcher call from the graph's wrapper, with fused
element-wise kernels between them. `kvserve_stack.Stack` runs the same layers with the same kernels
(kvserve_cpu's GEMVs for every projection, kvserve_attn's decode ops for the cache write and the
attention) and does the element-wise work (RMSNorms, rotary embedding, residuals, the SiLU or GELU
product) itself, with no Python, no graph and no compile. `build` describes a model to it once
(`LAYER_FORMS`: how each supported layer class maps onto the stack's layer); it returns None where
a layer is not one it runs (another architecture, a projection whose few-row kernel is not one of
kvserve's GEMVs, non-float32 activations), and the graphs serve that model.
Compiled like the other kernels (kvserve/native.py); `available()` is False where the build fails.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    def __init__(self, stack, ropes):
        self.stack, self.ropes = stack, ropes

    def __call__(self, layers, x: torch.Tensor, positions: torch.Tensor, inputs) -> torch.Tensor:
        rows = x.shape[0]
        for layer in layers:
            vars(layer.self_attn)["kv_rows"] += rows   # as the graphs count (model/regions.py)
        return self.stack.run(x, positions, [r.cos for r in self.ropes], [r.sin for r in self.ropes],
                              list(inputs.slots), list(inputs.blocks), list(inputs.spans))


@dataclass
class LayerForm:
    """One layer as the stack takes it: its norms (the factors they apply, None where it has none),
    their epsilon, the gate's activation, its rotary embedding module."""

    in_norm: torch.Tensor
    mlp_norm: torch.Tensor
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    activation: str
    rope: torch.nn.Module


def _llama_form(layer) -> LayerForm | None:
    """Llama, Qwen2, Qwen3, Mistral: pre-norm attention and SwiGLU, q/k norms where the model has them."""
    from kvserve.model.layers import GatedMLP, RMSNorm
    a = layer.self_attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm,
             *((a.q_norm, a.k_norm) if hasattr(a, "q_norm") else ())]
    if type(layer.mlp) is not GatedMLP or any(type(n) is not RMSNorm for n in norms) or len({n.eps for n in norms}) > 1:
        return None
    q, k = (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (None, None)
    return LayerForm(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, None, None, q, k,
                     layer.input_layernorm.eps, "silu", a.rope)


def _gemma3_form(layer) -> LayerForm | None:
    """Gemma 3: sandwich norms scaled by (1 + weight), q/k norms, tanh-GELU gate."""
    from kvserve.model.gemma3 import GemmaMLP, GemmaRMSNorm
    a = layer.self_attn
    norms = [layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
             layer.post_feedforward_layernorm, a.q_norm, a.k_norm]
    if type(layer.mlp) is not GemmaMLP or any(type(n) is not GemmaRMSNorm for n in norms) or len({n.eps for n in norms}) > 1:
        return None
    factors = [(1.0 + n.weight.detach().float()).contiguous() for n in norms]   # GemmaRMSNorm's own factor
    return LayerForm(*factors, layer.input_layernorm.eps, "gelu_tanh", a.rope)


def _layer_forms() -> dict:
    from kvserve.model.gemma3 import Gemma3Attention, Gemma3DecoderLayer
    from kvserve.model.llama import LlamaAttention, LlamaDecoderLayer
    return {(LlamaDecoderLayer, LlamaAttention): _llama_form, (Gemma3DecoderLayer, Gemma3Attention): _gemma3_form}


def build(model: torch.nn.Module, pools, kv_index, groups, max_rows: int) -> NativeStack | None:
    """The native stack for `model`'s layers over `pools` (layer i's K and V at kv_index[i], its KV group
    groups[i]) serving steps of 1..max_rows decode rows, or None where it cannot run them."""
    layers = getattr(model.model, "layers", ())
    if not layers or not available():
        return None
    forms = [_layer_form(layer) for layer in layers]
    projections = [_projections(layer, max_rows) for layer in layers]
    if (any(f is None for f in forms) or any(p is None for p in projections) or len({f.activation for f in forms}) > 1
            or any(p.device.type != "cpu" or p.dtype != torch.float32 for layer in layers for p in layer.parameters())):
        return None
    ropes = list({id(f.rope): f.rope for f in forms}.values())
    if any(r.cos.dtype != torch.float32 for r in ropes):
        return None
    attn, mlp = layers[0].self_attn, layers[0].mlp
    hidden = forms[0].in_norm.numel()
    stack = torch.classes.kvserve_stack.Stack(attn.num_heads, attn.num_kv_heads, attn.head_dim, hidden,
                                               mlp.gate_up.sizes[0], forms[0].activation, list(pools))
    for layer, f, projection, (k, v), group in zip(layers, forms, projections, kv_index, groups):
        stack.add_layer(f.in_norm, f.mlp_norm, f.attn_out_norm, f.mlp_out_norm, f.q_norm, f.k_norm, f.eps,
                        layer.self_attn.scale, k, v, group, ropes.index(f.rope))
        for which, linears in zip(PROJECTIONS, projection):
            for kind, tensors, group_size, n, bias in linears:
                stack.add_linear(which, kind, *tensors, group_size, n, bias)
    return NativeStack(stack, ropes)


def _layer_form(layer) -> LayerForm | None:
    """`layer` as the stack takes it, or None where it is not a layer the stack runs (its rotary
    embedding the half-split one)."""
    from kvserve.model.layers import RotaryEmbedding
    a = getattr(layer, "self_attn", None)
    form = _layer_forms().get((type(layer), type(a)))
    if form is None or type(a.rope) is not RotaryEmbedding:
        return None
    return form(layer)


def _projections(layer, max_rows: int):
    """Each projection's linears as (kind, (a, b, c), group, outputs, bias) for Stack.add_linear, or None where
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
        out.append([(kind, tensors, group, m.out_features, m.bias) for (kind, tensors, group), m in zip(forms, members)])
    return out


def _members(fused) -> list:
    """The layers a fused group runs: its one quantized layer, or its members."""
    return [fused.quant] if fused.quant is not None else list(fused.linears)
