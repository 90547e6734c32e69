"""KV eviction policies: which cached entries of one layer survive (window, StreamingLLM sinks, H2O, SnapKV).

This module is pure selection logic over per-layer facts: the original token position of each
cached entry (in cache order) and, for H2O and SnapKV, the attention the entries received. The
evictor (kv/evictor.py) gathers the facts, compacts the survivors to the front of the group's
block table and gives the emptied blocks back to the pool.

One spec string names a policy everywhere (`LLM(kv_policy=...)`, `--kv-policy`, SamplingParams):

- `full`                     keep everything (the default).
- `window:W`                 keep the last W tokens; positions re-indexed (= `sinks:0,W`).
- `sinks:S,W`                StreamingLLM: the first S tokens (attention sinks) + the last W. Kept keys
                             are re-rotated to their rank inside the cache, and a new token's position
                             is its cache index, so positions never exceed S + W (a stream can run past
                             the model's trained context). `sinks:W` means S = 4.
- `h2o:HEAVY,RECENT`         H2O: attention each cached entry receives, accumulated at every step
                             (summed over all query heads of the layer); over budget, keep the top
                             HEAVY older entries plus the last RECENT. Positions kept.
- `snapkv:BUDGET[,WINDOW[,KERNEL[,POOL]]]`
                             SnapKV, once after prefill: attention of the last WINDOW (32) prompt
                             queries, averaged over each GQA group, pooled over KERNEL (7) neighbours
                             (max | avg), averaged over KV heads; keep the top BUDGET - WINDOW plus the
                             window. Decode then runs uncompressed. Positions kept.
- `random:BUDGET[,WINDOW[,SEED]]`
                             the baseline: once after prefill, the observation window plus random others.

Budgets (W, HEAVY, RECENT, BUDGET) may be ratios of the prompt length: `snapkv:0.5` keeps half of
the prompt. A token's slot holds all of its KV heads, so every policy selects per layer (not per head:
head-wise budgets would need per-head block tables; kvpress only simulates them by masking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

KINDS = ("full", "window", "sinks", "h2o", "snapkv", "random")
USAGE = ("use full, window:W, sinks:S,W, h2o:HEAVY,RECENT, snapkv:BUDGET[,WINDOW[,KERNEL[,max|avg]]] or "
         "random:BUDGET[,WINDOW[,SEED]] (budgets in tokens, or a ratio of the prompt such as snapkv:0.5)")


@dataclass(frozen=True)
class KVPolicy:
    """A parsed policy; budgets are tokens (int) or ratios of the prompt (float < 1) until `resolve`."""

    kind: str = "full"
    sinks: int = 0               # sinks: first tokens always kept
    recent: float = 0            # window/sinks: last tokens kept; h2o: recent tokens kept
    heavy: float = 0             # h2o: heavy hitters kept
    budget: float = 0            # snapkv/random: tokens kept after prefill
    window: int = 32             # snapkv/random: observation window (last prompt tokens)
    kernel: int = 7              # snapkv: pooling kernel
    pool: str = "max"            # snapkv: max | avg
    seed: int = 0                # random

    # ---- what kind of policy ---------------------------------------------------------------
    @property
    def evicts(self) -> bool:
        """False for `full`."""
        return self.kind != "full"

    @property
    def reindex(self) -> bool:
        """True when kept keys are re-rotated to their cache index (window, sinks)."""
        return self.kind in ("window", "sinks")

    @property
    def streaming(self) -> bool:
        """True when the policy holds the cache at its capacity after every step."""
        return self.kind in ("window", "sinks", "h2o")

    @property
    def one_shot(self) -> bool:
        """True when the policy compresses once, after prefill (snapkv, random)."""
        return self.kind in ("snapkv", "random")

    @property
    def scores(self) -> str | None:
        """Attention the policy needs: 'all' queries (h2o), the observation 'window' (snapkv), None."""
        return {"h2o": "all", "snapkv": "window"}.get(self.kind)

    @property
    def is_resolved(self) -> bool:
        """True when every budget is a token count."""
        return all(float(x).is_integer() for x in (self.recent, self.heavy, self.budget))

    # ---- budgets -------------------------------------------------------------------------------
    def resolve(self, prompt_len: int) -> KVPolicy:
        """Ratios of the prompt turned into token counts (at least 1 where a budget is asked)."""
        def tokens(x: float) -> int:
            if float(x).is_integer():
                return int(x)
            return max(1, math.floor(x * prompt_len))
        return replace(self, recent=tokens(self.recent), heavy=tokens(self.heavy), budget=tokens(self.budget))

    @property
    def capacity(self) -> int | None:
        """Entries per layer the policy keeps (resolved policies); None for full."""
        if self.kind in ("window", "sinks"):
            return self.sinks + int(self.recent)
        if self.kind == "h2o":
            return int(self.heavy + self.recent)
        if self.one_shot:
            return int(self.budget)
        return None

    def cache_bound(self, prompt_len: int, total_len: int, chunk: int) -> int:
        """Most entries one layer holds at any time for a request of `total_len` tokens whose prefill
        runs in chunks of at most `chunk` tokens (resolved policies)."""
        if self.streaming:
            return min(total_len, self.capacity + max(1, min(chunk, prompt_len)))
        if self.one_shot:
            return max(prompt_len, min(prompt_len, self.capacity) + total_len - prompt_len)
        return total_len

    def position_bound(self, prompt_len: int, chunk: int) -> int | None:
        """Positions a request under this policy uses stay below this however long it runs: re-indexing
        policies place every token at its cache index (at most capacity + one prefill chunk); None when
        positions are the original ones and grow with the stream (resolved policies)."""
        if not self.reindex:
            return None
        return self.capacity + max(1, min(chunk, prompt_len))

    # ---- selection -----------------------------------------------------------------------------
    def select(self, pos: torch.Tensor, scores: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """Indices (ascending) of the cached entries to keep; `pos` [n] original positions in cache
        order, `scores` [n] per-entry importance (h2o, snapkv: see `snapkv_scores`)."""
        if self.kind in ("window", "sinks"):
            return keep_sinks_window(pos, self.sinks, int(self.recent))
        if self.kind == "h2o":
            return keep_heavy_recent(pos, scores, int(self.heavy), int(self.recent))
        if self.kind == "snapkv":
            return keep_window_and_top(pos, scores, int(self.budget), self.window)
        if self.kind == "random":
            return keep_random(pos, int(self.budget), self.window, generator)
        return torch.arange(pos.numel(), device=pos.device)

    def spec(self) -> str:
        """The spec string of this policy."""
        def n(x):
            return str(int(x)) if float(x).is_integer() else f"{x:g}"
        if self.kind == "window":
            return f"window:{n(self.recent)}"
        if self.kind == "sinks":
            return f"sinks:{self.sinks},{n(self.recent)}"
        if self.kind == "h2o":
            return f"h2o:{n(self.heavy)},{n(self.recent)}"
        if self.kind == "snapkv":
            return f"snapkv:{n(self.budget)},{self.window},{self.kernel},{self.pool}"
        if self.kind == "random":
            return f"random:{n(self.budget)},{self.window},{self.seed}"
        return "full"


FULL = KVPolicy()


def parse_policy(text: str | KVPolicy | None) -> KVPolicy:
    """'sinks:4,1020', 'h2o:64,64', 'snapkv:0.5', ... -> KVPolicy (ValueError naming what is wrong)."""
    if isinstance(text, KVPolicy):
        return text
    if text is None or str(text).strip().lower() in ("", "full", "none"):
        return FULL
    kind, _, rest = str(text).strip().lower().partition(":")
    args = [a.strip() for a in rest.split(",")] if rest.strip() else []
    try:
        policy = _build(kind, args)
    except (ValueError, IndexError) as e:
        raise ValueError(f"bad kv_policy {text!r}: {e}; {USAGE}") from None
    return policy


def _build(kind: str, args: list[str]) -> KVPolicy:
    if kind not in KINDS:
        raise ValueError(f"unknown policy {kind!r}")
    need = {"window": (1, 1), "sinks": (1, 2), "h2o": (2, 2), "snapkv": (1, 4), "random": (1, 3), "full": (0, 0)}
    lo, hi = need[kind]
    if not lo <= len(args) <= hi:
        raise ValueError(f"{kind} takes {lo}..{hi} numbers, got {len(args)}")
    if kind == "window":
        return KVPolicy("window", recent=_budget(args[0], "W"))
    if kind == "sinks":
        sinks = _int(args[0], "S", 0) if len(args) == 2 else 4
        return KVPolicy("sinks", sinks=sinks, recent=_budget(args[-1], "W"))
    if kind == "h2o":
        return KVPolicy("h2o", heavy=_budget(args[0], "HEAVY", 0), recent=_budget(args[1], "RECENT"))
    if kind == "snapkv":
        pool = args[3] if len(args) > 3 else "max"
        if pool not in ("max", "avg"):
            raise ValueError(f"pool must be max or avg, got {pool!r}")
        return KVPolicy("snapkv", budget=_budget(args[0], "BUDGET"),
                        window=_int(args[1], "WINDOW", 1) if len(args) > 1 else 32,
                        kernel=_int(args[2], "KERNEL", 1) if len(args) > 2 else 7, pool=pool)
    if kind == "random":
        return KVPolicy("random", budget=_budget(args[0], "BUDGET"),
                        window=_int(args[1], "WINDOW", 0) if len(args) > 1 else 32,
                        seed=_int(args[2], "SEED", 0) if len(args) > 2 else 0)
    return FULL


def _int(s: str, name: str, lo: int) -> int:
    if not s.isdigit() or int(s) < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {s!r}")
    return int(s)


def _budget(s: str, name: str, lo: int = 1) -> float:
    """A token count (integer >= lo) or a ratio of the prompt in (0, 1)."""
    if s.isdigit():
        return _int(s, name, lo)
    try:
        x = float(s)
    except ValueError:
        raise ValueError(f"{name} must be a token count or a ratio in (0, 1), got {s!r}") from None
    if not 0 < x < 1:
        raise ValueError(f"{name} must be a token count or a ratio in (0, 1), got {s!r}")
    return x


# ---- selection functions (exact, deterministic; ties go to the earlier position) ---------------


def _ranks(pos: torch.Tensor) -> torch.Tensor:
    """Rank of each entry by original position (0 = oldest)."""
    return torch.argsort(torch.argsort(pos, stable=True), stable=True)


def _top(pos: torch.Tensor, scores: torch.Tensor, k: int, exclude: torch.Tensor) -> torch.Tensor:
    """Indices of the k best scores outside `exclude`; ties go to the earlier position."""
    if k <= 0:
        return torch.zeros(0, dtype=torch.long, device=pos.device)
    by_pos = torch.argsort(pos, stable=True)
    s = scores.float().clone()
    s[exclude] = -math.inf
    order = torch.argsort(s[by_pos], descending=True, stable=True)
    top = by_pos[order[:k]]
    return top[~exclude[top]]


def keep_sinks_window(pos: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """The `sinks` oldest entries and the `recent` newest (StreamingLLM)."""
    n = pos.numel()
    if n <= sinks + recent:
        return torch.arange(n, device=pos.device)
    r = _ranks(pos)
    return ((r < sinks) | (r >= n - recent)).nonzero().flatten()


def keep_heavy_recent(pos: torch.Tensor, scores: torch.Tensor, heavy: int, recent: int) -> torch.Tensor:
    """The `recent` newest entries plus the `heavy` older ones with the highest scores (H2O)."""
    n = pos.numel()
    if n <= heavy + recent:
        return torch.arange(n, device=pos.device)
    is_recent = _ranks(pos) >= n - recent
    keep = is_recent.clone()
    keep[_top(pos, scores, heavy, is_recent)] = True
    return keep.nonzero().flatten()


def keep_window_and_top(pos: torch.Tensor, scores: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """The newest `window` entries (the observation window) plus the best `budget - window` others
    (SnapKV); with budget <= window, the newest `budget`."""
    n = pos.numel()
    if n <= budget:
        return torch.arange(n, device=pos.device)
    w = min(window, budget)
    in_window = _ranks(pos) >= n - w
    keep = in_window.clone()
    keep[_top(pos, scores, budget - w, in_window)] = True
    return keep.nonzero().flatten()


def keep_random(pos: torch.Tensor, budget: int, window: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """The newest `window` entries plus `budget - window` others drawn uniformly (a baseline)."""
    n = pos.numel()
    if n <= budget:
        return torch.arange(n, device=pos.device)
    w = min(window, budget)
    scores = torch.rand(n, generator=generator).to(pos.device)
    return keep_window_and_top(pos, scores, budget, w)


def snapkv_scores(attn: torch.Tensor, pos: torch.Tensor, num_kv_heads: int, kernel: int, pool: str = "max") -> torch.Tensor:
    """attn [num_heads, n] (observation-window attention summed over its queries) -> [n]: averaged
    over each GQA group, pooled over `kernel` neighbours in position order, averaged over KV heads."""
    hq, n = attn.shape
    g = attn.float().view(num_kv_heads, hq // num_kv_heads, n).mean(1)       # [kv_heads, n]
    order = torch.argsort(pos, stable=True)
    x = g[:, order]
    if kernel > 1:
        pad = kernel // 2
        if pool == "max":
            x = F.max_pool1d(F.pad(x[None], (pad, kernel - 1 - pad), value=-math.inf), kernel, stride=1)[0]
        else:
            x = F.avg_pool1d(x[None], kernel, stride=1, padding=pad, count_include_pad=False)[0][:, :n]
    out = torch.empty_like(x)
    out[:, order] = x
    return out.mean(0)
