"""Logits -> tokens: token filters, min_tokens, penalties, temperature, top-k/p, min-p, seeds, logprobs.

Processing order follows vLLM: a structured-output bitmask, allowed_token_ids, logit_bias and
bad_words, min_tokens masking, repetition penalty, presence and frequency penalties; then greedy rows take the argmax and random rows go through
temperature, top-k, top-p and min-p before a multinomial draw. Reported log-probs come
from the raw model distribution (log_softmax of the unprocessed logits), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.outputs import Logprob
from kvserve.sampling_params import SamplingParams
from kvserve.structured.grammar import apply_bitmask

_NEG_INF = float("-inf")
_FLOAT32_MAX = torch.finfo(torch.float32).max


class SamplingError(ValueError):
    """Some rows cannot be sampled: their processed logits hold NaN or no finite value."""

    def __init__(self, rows: list[int]):
        super().__init__(f"rows {rows} of the logits are NaN or have no finite value after "
                         "the sampling parameters were applied: no token can be drawn")
        self.rows = rows


@dataclass
class SamplingInput:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    num_samples: int = 1
    bad_words: list[list[int]] = field(default_factory=list)   # token ids of each of params.bad_words


@dataclass
class SampleResult:
    """The tokens drawn for one row, their raw log-probs and optional top log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, Logprob]] | None


def request_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded for one request."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


# ---------------------------------------------------------------- logits processing


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_active(inp: SamplingInput) -> bool:
    return len(inp.output_token_ids) < inp.params.min_tokens


def apply_min_tokens(logits: torch.Tensor, inputs: list[SamplingInput],
                     eos_token_ids: list[int]) -> torch.Tensor:
    """Mask EOS (unless ignore_eos) and stop_token_ids to -inf below min_tokens (in place)."""
    vocab = logits.shape[-1]
    for row, inp in enumerate(inputs):
        if not _min_tokens_active(inp):
            continue
        banned = list(inp.params.stop_token_ids)
        if not inp.params.ignore_eos:
            banned += eos_token_ids
        banned = [t for t in banned if 0 <= t < vocab]
        if banned:
            logits[row, banned] = _NEG_INF
    return logits


def _has_token_filters(inp: SamplingInput) -> bool:
    p = inp.params
    return p.logit_bias is not None or p.allowed_token_ids is not None or bool(inp.bad_words)


def apply_token_filters(logits: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
    """allowed_token_ids (every other token -inf), logit_bias (added) and bad_words (the token that
    would complete one -inf) of each row (in place)."""
    vocab = logits.shape[-1]
    for row, inp in enumerate(inputs):
        p = inp.params
        if p.allowed_token_ids is not None:
            keep = torch.full((vocab,), _NEG_INF, device=logits.device)
            keep[[t for t in p.allowed_token_ids if t < vocab]] = 0.0
            logits[row] += keep
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            logits[row, ids] += torch.tensor([p.logit_bias[t] for t in ids], device=logits.device)
        banned = [w[-1] for w in inp.bad_words if _completes(inp.output_token_ids, w)]
        if banned:
            logits[row, banned] = _NEG_INF
    return logits


def _completes(output: list[int], word: list[int]) -> bool:
    """True when the next token `word[-1]` would complete `word` after `output`."""
    head = word[:-1]
    return not head or output[-len(head):] == head


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token id per row. # [rows, vocab]"""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    # pad with `vocab` (an extra, discarded column); ids outside the vocab go there too
    padded = [[t if 0 <= t < vocab else vocab for t in ts] + [vocab] * (width - len(ts))
              for ts in token_lists]
    index = torch.tensor(padded, dtype=torch.long, device=device)  # [rows, width]
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """A [rows, 1] float32 tensor of per-row values."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _penalize(logits: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
    """Penalties for rows that all have some penalty. # [rows, vocab] -> [rows, vocab]"""
    vocab, device = logits.shape[-1], logits.device
    params = [inp.params for inp in inputs]
    out_counts = _token_counts([inp.output_token_ids for inp in inputs], vocab, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _token_counts([inp.prompt_token_ids for inp in inputs], vocab, device)
        seen = (prompt_counts + out_counts) > 0
        rep = _column([p.repetition_penalty for p in params], device)
        rep = torch.where(seen, rep, torch.ones_like(rep))
        logits = torch.where(logits > 0, logits / rep, logits * rep).clamp_(max=_FLOAT32_MAX)
    freq = _column([p.frequency_penalty for p in params], device)
    presence = _column([p.presence_penalty for p in params], device)
    return logits - freq * out_counts - presence * (out_counts > 0).float()


def apply_penalties(logits: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
    """Repetition (prompt+output), frequency and presence (output) penalties (in place)."""
    rows = [i for i, inp in enumerate(inputs) if _has_penalties(inp.params)]
    if rows:
        logits[rows] = _penalize(logits[rows], [inputs[i] for i in rows])
    return logits


def apply_temperature(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """Divide each row by its temperature (in place); rows must not be greedy."""
    if any(t != 1.0 for t in temperatures):
        logits.div_(_column(temperatures, logits.device)).clamp_(max=_FLOAT32_MAX)
    return logits


def _apply_top_k_only(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Top-k via topk(max k) instead of a full sort (in place); ties with the kth stay."""
    vocab, device = logits.shape[-1], logits.device
    ks = [min(k, vocab) if k > 0 else 0 for k in top_ks]
    top_vals = logits.topk(max(ks), dim=-1).values  # [rows, max_k]
    index = torch.tensor([max(k - 1, 0) for k in ks], device=device).unsqueeze(1)
    kth = top_vals.gather(1, index)  # [rows, 1]
    kth.masked_fill_(torch.tensor(ks, device=device).unsqueeze(1) == 0, _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int],
                      top_ps: list[float]) -> torch.Tensor:
    """Keep each row's top-k logits (k <= 0: off), then its top-p nucleus; the rest -> -inf.

    May modify `logits` in place; use the returned tensor.
    """
    vocab, device = logits.shape[-1], logits.device
    use_k = any(k > 0 for k in top_ks)
    use_p = any(p < 1.0 for p in top_ps)
    if not (use_k or use_p):
        return logits
    if not use_p:
        return _apply_top_k_only(logits, top_ks)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    if use_k:
        ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=device)
        kth = sorted_logits.gather(1, (ks - 1).unsqueeze(1))  # [rows, 1]; ties with kth stay
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    if use_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        ps = _column(top_ps, device)
        drop = (mass_before >= ps) & (ps < 1.0)
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * the row's top probability (in place)."""
    if not any(p > 0.0 for p in min_ps):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = _column(min_ps, logits.device) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_sampling_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for non-greedy rows (in place where possible)."""
    logits = apply_temperature(logits, [p.temperature for p in params])
    logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params])
    return apply_min_p(logits, [p.min_p for p in params])


def _random_rows(inputs: list[SamplingInput]) -> list[int]:
    return [i for i, inp in enumerate(inputs) if not inp.params.greedy]


def process_logits(logits: torch.Tensor, inputs: list[SamplingInput],
                   eos_token_ids: list[int]) -> torch.Tensor:
    """The logits each row samples from; greedy rows get only min_tokens and penalties.

    Returns `logits` itself when nothing applies, else a processed copy.
    """
    rand = _random_rows(inputs)
    touched = rand or any(_min_tokens_active(i) or _has_penalties(i.params) or _has_token_filters(i) for i in inputs)
    if not touched:
        return logits
    logits = logits.clone()
    if any(_has_token_filters(i) for i in inputs):
        logits = apply_token_filters(logits, inputs)
    logits = apply_penalties(apply_min_tokens(logits, inputs, eos_token_ids), inputs)
    if len(rand) == len(inputs):
        return apply_sampling_filters(logits, [inp.params for inp in inputs])
    if rand:
        logits[rand] = apply_sampling_filters(logits[rand], [inputs[i].params for i in rand])
    return logits


# ---------------------------------------------------------------- drawing tokens


@dataclass
class RowStats:
    """Of each row of a step's logits: its maximum (NaN where the row holds a NaN), the index of its
    first maximum, its log-sum-exp (a tensor [rows]: log-probs are logit - lse) and the maximum's
    log-prob (the greedy token's)."""

    peak: list[float]
    argmax: list[int]
    lse: torch.Tensor
    top_logprob: list[float]

    def check(self) -> None:
        """Raise SamplingError naming the rows that hold NaN, +inf, or nothing but -inf."""
        bad = [i for i, top in enumerate(self.peak) if not _NEG_INF < top < float("inf")]
        if bad:
            raise SamplingError(bad)


def torch_row_stats(logits: torch.Tensor) -> RowStats:
    """RowStats by torch's reductions (any device)."""
    peak = logits.amax(dim=-1)  # [rows]; NaN when the row holds a NaN
    lse = logits.logsumexp(dim=-1)
    return RowStats(peak.tolist(), logits.argmax(dim=-1).tolist(), lse, (peak - lse).tolist())


def kernel_row_stats(logits: torch.Tensor) -> RowStats:
    """RowStats in one pass over each row (engine/cpu/rows.cpp; float32 CPU logits, rows of any stride)."""
    stats = torch.ops.kvserve_rows.row_stats(logits if logits.stride(-1) == 1 else logits.contiguous())
    peak, argmax, lse, top = zip(*stats.tolist()) if len(stats) else ((),) * 4
    return RowStats(list(peak), [int(i) for i in argmax], stats[:, 2].float(), list(top))


def row_stats_for(device: torch.device | str) -> Callable[[torch.Tensor], RowStats]:
    """The kernel on a CPU that builds it, else torch's reductions."""
    from kvserve.engine import cpu
    return kernel_row_stats if torch.device(device).type == "cpu" and cpu.available() else torch_row_stats


def _draw(probs: torch.Tensor, inputs: list[SamplingInput],
          global_gen: torch.Generator) -> list[list[int]]:
    """Multinomial draws for random rows; seeded rows use only their own generator."""
    tokens: list[list[int] | None] = [None] * len(inputs)
    plain = [i for i, inp in enumerate(inputs) if inp.generator is None and inp.num_samples == 1]
    if plain:
        drawn = torch.multinomial(probs[plain], 1, generator=global_gen).squeeze(1).tolist()
        for i, t in zip(plain, drawn):
            tokens[i] = [t]
    for i, inp in enumerate(inputs):
        if tokens[i] is None:
            gen = inp.generator if inp.generator is not None else global_gen
            tokens[i] = torch.multinomial(probs[i], inp.num_samples, replacement=True,
                                          generator=gen).tolist()
    return tokens


def _top_logprobs(logits: torch.Tensor, lse: torch.Tensor, rows: list[int],
                  tokens: list[list[int]], ks: list[int]) -> list[list[dict[int, Logprob]]]:
    """For each row and sample: the chosen token and the row's top-k, ranked, raw log-probs."""
    sample_rows = [r for r in rows for _ in tokens[r]]
    flat = [t for r in rows for t in tokens[r]]
    chosen_logits = logits[sample_rows, flat]  # [samples]
    ranks = ((logits[sample_rows] > chosen_logits.unsqueeze(1)).sum(-1) + 1).tolist()
    chosen_lps = (chosen_logits - lse[sample_rows]).tolist()
    top_vals, top_ids = logits[rows].topk(min(max(ks), logits.shape[1]), dim=-1)
    top_lps = (top_vals - lse[rows].unsqueeze(1)).tolist()
    top_ids = top_ids.tolist()
    out, s = [], 0
    for j, r in enumerate(rows):
        per_sample = []
        for tok in tokens[r]:
            d = {tok: Logprob(chosen_lps[s], ranks[s])}
            for rank in range(min(ks[j], len(top_ids[j]))):
                d.setdefault(top_ids[j][rank], Logprob(top_lps[j][rank], rank + 1))
            per_sample.append(d)
            s += 1
        out.append(per_sample)
    return out


class Sampler:
    """Turns a batch of logits into tokens following each row's SamplingParams."""

    def __init__(self, eos_token_ids: list[int], vocab_size: int, seed: int | None = None,
                 device: torch.device | str = "cpu"):
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.seed = seed
        self.row_stats = row_stats_for(device)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _global_generator(self, device: torch.device) -> torch.Generator:
        """The sampler-wide RNG on `device`, made on first use."""
        if device not in self._generators:
            gen = torch.Generator(device=device)
            if self.seed is None:
                gen.seed()
            else:
                gen.manual_seed(self.seed)
            self._generators[device] = gen
        return self._generators[device]

    def _check_logits(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
        """Float32 logits cut to the vocab; raises on a shape mismatch."""
        if logits.dim() != 2 or logits.shape[0] != len(inputs):
            raise ValueError(f"logits must be [num_rows={len(inputs)}, vocab], "
                             f"got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than "
                             f"vocab_size={self.vocab_size}")
        return logits[:, : self.vocab_size].float()

    def _sample_tokens(self, processed: torch.Tensor, inputs: list[SamplingInput],
                       argmax: list[int]) -> list[list[int]]:
        """Argmax (`argmax`, of `processed`) for greedy rows, multinomial draws for the rest."""
        tokens = [[t] * inp.num_samples for t, inp in zip(argmax, inputs)]
        rand = _random_rows(inputs)
        if rand:
            probs = processed[rand].softmax(dim=-1)
            gen = self._global_generator(processed.device)
            for i, toks in zip(rand, _draw(probs, [inputs[i] for i in rand], gen)):
                tokens[i] = toks
        return tokens

    @staticmethod
    def _chosen_logprobs(logits: torch.Tensor, stats: RowStats, tokens: list[list[int]]) -> list[float]:
        """The raw log-prob of each drawn token, row by row: a row's first maximum's from `stats`,
        any other token's gathered (logit - lse)."""
        chosen = [stats.top_logprob[i] if t == stats.argmax[i] else None
                  for i, toks in enumerate(tokens) for t in toks]
        rows = [i for i, toks in enumerate(tokens) for _ in toks]
        flat = [t for toks in tokens for t in toks]
        rest = [j for j, lp in enumerate(chosen) if lp is None]
        if rest:
            picked = [rows[j] for j in rest]
            for j, lp in zip(rest, (logits[picked, [flat[j] for j in rest]] - stats.lse[picked]).tolist()):
                chosen[j] = lp
        return chosen

    def __call__(self, logits: torch.Tensor, inputs: list[SamplingInput],
                 bitmask: torch.Tensor | None = None) -> list[SampleResult]:
        """Sample `num_samples` tokens per row. logits: [num_rows, vocab]; `bitmask` (int32 [rows,
        words], structured outputs) allows only its tokens, before any other processing (reported
        log-probs stay the model's)."""
        if not inputs:
            return []
        logits = self._check_logits(logits, inputs)
        stats = self.row_stats(logits)
        allowed = logits if bitmask is None else apply_bitmask(logits.clone(), bitmask)
        processed = process_logits(allowed, inputs, self.eos_token_ids)
        # rows nothing processed (plain greedy ones) take the raw logits' statistics
        kept = stats if processed is logits else self.row_stats(processed)
        kept.check()
        tokens = self._sample_tokens(processed, inputs, kept.argmax)
        lse = stats.lse  # [rows]
        chosen = self._chosen_logprobs(logits, stats, tokens)
        lp_rows = [i for i, inp in enumerate(inputs) if inp.params.logprobs is not None]
        tops = (_top_logprobs(logits, lse, lp_rows, tokens,
                              [inputs[i].params.logprobs for i in lp_rows]) if lp_rows else [])
        top_by_row = dict(zip(lp_rows, tops))
        results, start = [], 0
        for i, toks in enumerate(tokens):
            results.append(SampleResult(toks, chosen[start:start + len(toks)], top_by_row.get(i)))
            start += len(toks)
        return results


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int],
                    k: int) -> list[dict[int, Logprob] | None]:
    """vLLM prompt logprobs: None for the first token, then each next token's and the top-k.

    logits: [len(prompt) - 1, vocab]; row i predicts prompt token i + 1.
    """
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        return []
    if logits.dim() != 2 or logits.shape[0] != num_prompt - 1:
        raise ValueError(f"logits must be [len(prompt) - 1 = {num_prompt - 1}, vocab], "
                         f"got {tuple(logits.shape)}")
    if num_prompt == 1:
        return [None]
    logits = logits.float()
    lse = logits.logsumexp(dim=-1, keepdim=True)  # [P-1, 1]
    targets = torch.tensor(prompt_token_ids[1:], device=logits.device).unsqueeze(1)
    target_logits = logits.gather(1, targets)  # [P-1, 1]
    ranks = ((logits > target_logits).sum(-1) + 1).tolist()
    target_lps = (target_logits - lse).squeeze(1).tolist()
    top_ids, top_lps = [], []
    if k > 0:
        top_vals, ids = logits.topk(min(k, logits.shape[1]), dim=-1)
        top_ids, top_lps = ids.tolist(), (top_vals - lse).tolist()
    out: list[dict[int, Logprob] | None] = [None]
    for i, tok in enumerate(prompt_token_ids[1:]):
        d = {tok: Logprob(target_lps[i], ranks[i])}
        for rank in range(len(top_ids[i]) if k > 0 else 0):
            d.setdefault(top_ids[i][rank], Logprob(top_lps[i][rank], rank + 1))
        out.append(d)
    return out
