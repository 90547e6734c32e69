"""Per-KV-head sensitivity to cache quantization, measured once on a short calibration text.

For every layer the engine runs one no-cache forward over `CALIBRATION_TOKENS` tokens of Python's
own documentation (`pydoc_data.topics`; seeded random ids for a model without a tokenizer) and
records q, k, v. For each KV head it compares that head's attention output with exact K/V and
with K/V passed through the cache format (`formats.roundtrip`): error = |o' - o|^2 / |o|^2 over
the head's query group. The scores are saved next to the model's weight cache
(`<cache dir>/kv_head_sensitivity.json`, one entry per format) and reused by later engines.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.attention import AttentionMetadata, PrefillSpan, window_mask
from kvserve.kv.formats import canonical_kv_dtype, hadamard, make_codec, roundtrip
from kvserve.kv.spec import KVGroup

log = logging.getLogger("kvserve")

CALIBRATION_TOKENS = 512
CALIBRATION_FILE = "kv_head_sensitivity.json"


def calibration_ids(tokenizer, vocab_size: int, n: int = CALIBRATION_TOKENS) -> list[int]:
    """`n` token ids of deterministic text (or seeded random ids without a tokenizer)."""
    if tokenizer is not None:
        from pydoc_data.topics import topics
        text = "\n\n".join(topics[k] for k in sorted(topics))[:20 * n]
        ids = tokenizer.encode(text)
        if len(ids) >= n:
            return ids[:n]
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


@torch.inference_mode()
def capture_qkv(model, ids: list[int], device) -> dict[int, tuple]:
    """{layer: (q, k, v, scale, window)} from one no-cache forward over `ids`."""
    seen: dict[int, tuple] = {}

    def observe(layer, q, k, v, scale, window):
        seen[layer] = (q.float().cpu(), k.float().cpu(), v.float().cpu(), scale, window)

    n = len(ids)
    model(torch.tensor(ids, device=device), torch.arange(n, device=device),
          AttentionMetadata(prefills=[PrefillSpan(0, n, n)], observers=(observe,)))
    return seen


def head_errors(q, k, v, scale, window, k_name: str, v_name: str, block_size: int,
                rotation: bool = False) -> list[float]:
    """Relative attention-output error per KV head when K/V pass through the formats."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if rotation:
        rot = hadamard(d)
        q, k, v = q @ rot, k @ rot, v @ rot
    kq = roundtrip(make_codec(k_name, "k", (hkv, d), torch.float32), k, block_size)
    vq = roundtrip(make_codec(v_name, "v", (hkv, d), torch.float32), v, block_size)
    pos = torch.arange(t)
    mask = window_mask(pos, pos, window)
    group = hq // hkv
    errors = []
    for h in range(hkv):
        qh = q[:, h * group:(h + 1) * group].transpose(0, 1)          # [G, T, D]

        def attn(kk, vv):
            return F.scaled_dot_product_attention(qh, kk[:, h].expand(group, t, d), vv[:, h].expand(group, t, d),
                                                  attn_mask=mask, scale=scale)
        ref, got = attn(k, v), attn(kq, vq)
        errors.append(float((got - ref).pow(2).sum() / ref.pow(2).sum().clamp(min=1e-30)))
    return errors


def head_sensitivity(loaded, device, k_name: str, v_name: str, rotation: bool,
                     block_size: int) -> list[list[float]]:
    """Per layer, per KV head: the error the format causes (loaded from, or saved to, the cache file);
    `loaded`: the engine's LoadedModel (model, tokenizer, dtype, path) on `device`."""
    from kvserve.model.loader import cache_dir_for
    key = f"K={k_name} V={v_name} rotation={rotation} block={block_size} dtype={loaded.dtype}"
    path = Path(cache_dir_for(loaded.path)) / CALIBRATION_FILE
    saved = _load(path)
    if key in saved:
        return saved[key]["scores"]
    n = CALIBRATION_TOKENS - CALIBRATION_TOKENS % block_size
    ids = calibration_ids(loaded.tokenizer, loaded.config.vocab_size, n)
    seen = capture_qkv(loaded.model, ids, device)
    if not seen:
        raise ValueError("kv_cache_head_precision needs a model with per-head attention (not MLA)")
    scores = [head_errors(*seen[layer], k_name, v_name, block_size, rotation) for layer in sorted(seen)]
    saved[key] = {"tokens": n, "scores": scores}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=1))
        log.info("KV head sensitivity for %s written to %s", key, path)
    except OSError as exc:
        log.warning("could not save KV head sensitivity to %s: %s", path, exc)
    return scores


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def choose_high_precision_heads(loaded, device, groups: list[KVGroup], cfg) -> dict[int, list[int]]:
    """{pool slot: KV heads kept in kv_cache_head_precision_dtype}: the most sensitive share."""
    if groups[0].spec.latent:
        raise ValueError("kv_cache_head_precision needs a model with per-head attention (not MLA)")
    base = canonical_kv_dtype(cfg.kv_cache_dtype)
    k_name = canonical_kv_dtype(cfg.kv_cache_dtype_k or base)
    v_name = canonical_kv_dtype(cfg.kv_cache_dtype_v or base)
    scores = head_sensitivity(loaded, device, k_name, v_name, cfg.kv_cache_rotation, cfg.block_size)
    slot_scores: dict[tuple[int, int], float] = {}
    for g in groups:  # layers sharing a slot share its format: a slot head is as sensitive as its worst layer
        for j, layer in enumerate(g.layers):
            for h, s in enumerate(scores[layer]):
                slot_scores[(j, h)] = max(slot_scores.get((j, h), 0.0), s)
    count = max(1, math.ceil(cfg.kv_cache_head_precision * len(slot_scores) - 1e-9))
    chosen = sorted(slot_scores, key=lambda p: -slot_scores[p])[:count]
    out: dict[int, list[int]] = {}
    for j, h in sorted(chosen):
        out.setdefault(j, []).append(h)
    log.info("KV head precision: %d of %d (slot, KV head) pairs in %s, most sensitive first: %s", count,
             len(slot_scores), cfg.kv_cache_head_precision_dtype, chosen[:8])
    return out
