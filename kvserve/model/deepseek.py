"""DeepSeek-V2/V3 decoders: multi-head latent attention (MLA) over a latent-only paged cache, MoE MLPs.

The cache holds, per layer and token, one vector: the RMSNorm'd KV latent c_kv (kv_lora_rank)
followed by the RoPE'd shared key k_pe (qk_rope_head_dim). Attention always runs in the
absorbed form: kv_b_proj's weight splits into W_UK [H, nope, r] and W_UV [H, v, r]; the query
becomes cat(q_nope @ W_UK, q_pe) per head, the one shared key is cat(c_kv, k_pe) and the value
is c_kv (MQA with one KV head, key dim r + rope, value dim r); the latent output goes through
W_UV and o_proj. Per-head keys and values are never built, neither in prefill nor in decode.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import MLA, AttentionMetadata, attention
from kvserve.kv.spec import MLASpec
from kvserve.model.base import CausalLM
from kvserve.model.config import ModelConfig
from kvserve.model.layers import GatedMLP, RMSNorm

# transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps
LORA_NORM_EPS = 1e-6


# ---- RoPE ------------------------------------------------------------------------------
def deepseek_inv_freq(dim: int, theta: float, scaling: dict | None,
                      max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] in float32, cos/sin scale) exactly as transformers computes them."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    if kind == "default":
        return 1.0 / (theta ** exponents), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, max_positions)
    raise ValueError(f"DeepSeek RoPE type {kind!r} is not supported; supported: default, yarn")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, theta: float, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): blend interpolated and original frequencies."""
    original = s.get("original_max_position_embeddings") or max_positions
    factor = s.get("factor") or max_positions / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class DeepseekRope:
    """DeepSeek's decoupled RoPE on the qk_rope_head_dim slice, in float32.

    Pairs are adjacent (x0,x1),(x2,x3).. when `interleave` (V2 always, V3 with rope_interleave),
    else the two halves (rotate_half). Output layout as in transformers: V2's complex product
    keeps pairs interleaved; V3 writes all rotated first members, then all second members.
    """

    def __init__(self, cfg: ModelConfig):
        mla = cfg.mla
        self.interleave = mla.rope_interleave
        self.interleaved_out = cfg.architecture == "deepseek_v2"
        self.inv_freq, self.attention_scaling = deepseek_inv_freq(
            mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_tokens, 1, rope_dim/2] (float32, yarn-scaled) for these positions."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        s = self.attention_scaling
        return (freqs.cos() * s).unsqueeze(1), (freqs.sin() * s).unsqueeze(1)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, rope_dim]
        xf = x.float()
        if self.interleave:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.stack([r1, r2], dim=-1).flatten(-2) if self.interleaved_out else torch.cat([r1, r2], dim=-1)
        return out.to(x.dtype)

    def shift(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotated k_pe [m, rope_dim] (output layout) at p -> at p - delta: a pure rotation by
        -delta * inv_freq per pair (the yarn scale is already in x)."""
        xf = x.float()
        if self.interleaved_out:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            x1, x2 = xf.chunk(2, dim=-1)
        angle = delta.float()[:, None] * self.inv_freq.to(x.device)[None, :]
        cos, sin = angle.cos(), angle.sin()
        r1, r2 = x1 * cos + x2 * sin, x2 * cos - x1 * sin
        out = torch.stack([r1, r2], dim=-1).flatten(-2) if self.interleaved_out else torch.cat([r1, r2], dim=-1)
        return out.to(x.dtype)


# ---- attention -------------------------------------------------------------------------
class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed form, caching only [c_kv, k_pe] per token."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: DeepseekRope):
        super().__init__()
        m = cfg.mla
        self.layer = layer
        self.num_heads = h = cfg.num_heads
        self.nope, self.rope_dim = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.rank, self.v_dim = m.kv_lora_rank, m.v_head_dim
        hidden, qk = cfg.hidden_size, m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, hidden, bias=cfg.attention_out_bias)
        self.rope = rope
        self.scale = cfg.attention_scale()  # qk_head_dim**-0.5, times yarn mscale(all_dim)^2 when configured
        self.spec = MLASpec(latent_dim=m.kv_lora_rank, rope_dim=m.qk_rope_head_dim)
        self.math = MLA(m.kv_lora_rank)
        self.kv_rows = 0  # token rows pushed through kv_a_proj_with_mqa (instrumented, for `analyze`)

    def shift_keys(self, latent: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Cached latents [m, r + rope] whose k_pe was rotated at p -> rotated at p - delta (KV eviction)."""
        c_kv, k_pe = latent.split([self.rank, self.rope_dim], dim=-1)
        return torch.cat([c_kv, self.rope.shift(k_pe, delta)], dim=-1)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, r] and W_UV [H, v, r]: views of kv_b_proj.weight (no copy, never stale)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, positions, cos_sin, meta: AttentionMetadata):
        n, h = x.shape[0], self.num_heads
        q_nope, q_pe = self._query(x).view(n, h, -1).split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        self.kv_rows += n
        c_kv = self.kv_a_layernorm(c_kv)                                        # [n, r]
        q_pe = self.rope(q_pe, *cos_sin)                                        # [n, H, rope]
        k_pe = self.rope(k_pe.unsqueeze(1), *cos_sin).squeeze(1)                # [n, rope]
        w_uk, w_uv = self.absorbed_weights()
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)                      # [n, H, r]
        q = torch.cat([q_lat, q_pe], dim=-1)                                    # [n, H, r + rope]
        latent = torch.cat([c_kv, k_pe], dim=-1)                                # [n, r + rope]: the cache entry
        out = attention(self.layer, q, [latent], meta, self.scale, None, self.math)  # [n, H, r]
        o = torch.einsum("thr,hvr->thv", out, w_uv)                             # [n, H, v]
        return self.o_proj(o.reshape(n, h * self.v_dim))


# ---- MoE -------------------------------------------------------------------------------
class TopkRouter(nn.Module):
    """Expert choice as transformers' DeepseekV2TopkRouter (softmax) / DeepseekV3TopkRouter (sigmoid)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.n_routed_experts, cfg.hidden_size))
        if moe.scoring_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_routed_experts))
        elif moe.scoring_func != "softmax":
            raise ValueError(f"MoE scoring_func {moe.scoring_func!r} is not supported; supported: softmax, sigmoid")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())                      # [T, E]
        if moe.scoring_func == "softmax":
            weights, ids = self._softmax_choice(logits.softmax(dim=-1, dtype=torch.float32))
        else:
            weights, ids = self._sigmoid_choice(logits.sigmoid())
        return weights * moe.routed_scaling_factor, ids

    def _group_mask(self, scores: torch.Tensor, group_score) -> torch.Tensor:
        """[T, E] bool: experts inside the topk_group best of n_group groups."""
        t, e = scores.shape
        groups = self.moe.n_group or 1
        per_group = scores.view(t, groups, e // groups)
        best = group_score(per_group).topk(self.moe.topk_group or 1, dim=-1, sorted=False).indices
        mask = torch.zeros(t, groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        return mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)

    def _softmax_choice(self, scores):
        moe = self.moe
        if moe.topk_method == "group_limited_greedy":
            scores = scores.masked_fill(~self._group_mask(scores, lambda g: g.max(dim=-1).values), 0.0)
        elif moe.topk_method != "greedy":
            raise ValueError("softmax routing supports topk_method greedy or group_limited_greedy, "
                             f"got {moe.topk_method!r}")
        # transformers' DeepseekV2 router neither renormalises (norm_topk_prob) nor biases the choice
        return scores.topk(moe.num_experts_per_tok, dim=-1, sorted=False)

    def _sigmoid_choice(self, scores):
        moe = self.moe
        choice = scores + self.e_score_correction_bias.float()
        top2 = min(2, choice.shape[-1] // (moe.n_group or 1))
        choice = choice.masked_fill(~self._group_mask(choice, lambda g: g.topk(top2, dim=-1).values.sum(-1)),
                                    float("-inf"))
        ids = choice.topk(moe.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)  # the bias only chooses; weights are the plain sigmoid scores
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids


class Experts(nn.Module):
    """Routed SwiGLU experts in transformers' fused layout, run densely: one pass per chosen expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        counts = torch.bincount(ids.flatten(), minlength=self.gate_up_proj.shape[0])
        hit = counts.nonzero().flatten().tolist()  # one host sync, then only the chosen experts
        for e in hit:
            tok, slot = torch.where(ids == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class DeepseekMoE(nn.Module):
    """Routed experts plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate = TopkRouter(cfg)
        self.experts = Experts(moe.n_routed_experts, cfg.hidden_size, moe.moe_intermediate_size)
        shared = moe.moe_intermediate_size * moe.n_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, shared, cfg.mlp_bias) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


# ---- the stack -------------------------------------------------------------------------
class DeepseekDecoderLayer(nn.Module):
    """Pre-norm MLA + (dense SwiGLU or MoE) block."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: DeepseekRope, mlp_kind: str):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer, rope)
        self.mlp = (DeepseekMoE(cfg) if mlp_kind == "moe"
                    else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, cos_sin, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos_sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    """Embeddings, the layer stack, final norm; RoPE cos/sin computed once per step."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"DeepSeek models use silu MLPs; config says hidden_act={cfg.hidden_act!r}")
        self.rope = DeepseekRope(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kinds = cfg.mlp_kinds()
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, self.rope, kinds[i])
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, positions, cos_sin, meta)
        return self.norm(x)


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2/V3 decoder + LM head; one MLA latent entry per token and layer in the cache."""

    def __init__(self, cfg: ModelConfig):
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture} needs MLA dims (kv_lora_rank, qk_rope_head_dim, ...) "
                             "in its config")
        super().__init__(cfg, DeepseekModel(cfg))
