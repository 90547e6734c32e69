"""The attention formula of a layer, apart from where its K/V live: standard multi-head attention
with grouped K/V heads, or MLA over cached latents with the up-projections absorbed."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class MHA:
    """softmax(q k^T * scale) v with Hq query heads over Hkv K/V heads (Hq a multiple of Hkv)."""

    rotates = True  # a format's orthonormal rotation may be applied to q, k and v (formats.py)

    def out_shape(self, q: torch.Tensor, new: list[torch.Tensor]) -> tuple[int, ...]:
        return (q.shape[0], q.shape[1], new[1].shape[-1])

    def decode(self, q, entries, mask, scale):
        """q [B, Hq, D] over K, V [B, L, Hkv, D] (mask [B, 1, 1, L] bool) -> [B, Hq, D]."""
        ks, vs = entries
        o = F.scaled_dot_product_attention(q.unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)

    def prefill(self, q, entries, mask, scale):
        """q [n, Hq, D] over K, V [ctx, Hkv, D] (mask [n, ctx], or None = causal with n == ctx)."""
        k, v = entries
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def score_keys(self, entries: list[torch.Tensor]) -> torch.Tensor:
        """The keys eviction scores against: [..., Hkv, D]."""
        return entries[0]


class MLA:
    """Attention over cached latents [c_kv (rank) | k_pe (rope)]: the query arrives absorbed
    ([n, H, rank + rope]); the latent's first `rank` columns are the values; out [n, H, rank]."""

    rotates = False

    def __init__(self, rank: int):
        self.rank = rank

    def out_shape(self, q: torch.Tensor, new: list[torch.Tensor]) -> tuple[int, ...]:
        return (q.shape[0], q.shape[1], self.rank)

    def decode(self, q, entries, mask, scale):
        """q [B, H, r+rope] over kv [B, L, r+rope] (mask [B, 1, 1, L]): heads become the query rows."""
        (kv,) = entries
        o = F.scaled_dot_product_attention(q.unsqueeze(1), kv.unsqueeze(1), kv[..., :self.rank].unsqueeze(1),
                                           attn_mask=mask, scale=scale)
        return o.squeeze(1)

    def prefill(self, q, entries, mask, scale):
        """q [n, H, r+rope] over kv [ctx, r+rope] (mask [n, ctx], or None = causal with n == ctx)."""
        (kv,) = entries
        h = q.shape[1]
        k = kv.unsqueeze(0).expand(h, -1, -1)                  # [H, ctx, r+rope], a view
        v = kv[:, :self.rank].unsqueeze(0).expand(h, -1, -1)   # [H, ctx, r]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask,
                                           is_causal=mask is None, scale=scale)
        return o.transpose(0, 1)

    def score_keys(self, entries: list[torch.Tensor]) -> torch.Tensor:
        """One shared "KV head": every query head is in its group."""
        return entries[0].unsqueeze(-2)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float):
    """softmax(q k^T * scale + bias) v and its log-sum-exp, batched over the leading dims.

    q [N, H, M, D], k/v [N, H, S, D] (any strides with a unit last one), bias broadcast to
    [N, H, M, S] -> (out [N, H, M, D] in q's dtype, lse [N, H, M] float32). On CPU this is torch's
    fused flash kernel (no [M, S] score tensor per head in memory); elsewhere the same in float32."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias.to(q.dtype), scale=scale)
        return out, lse
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale + bias
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse
