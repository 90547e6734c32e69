"""`kvserve eval kv-quant`: what a quantized KV cache costs in quality, against a full-precision cache.

Protocol (a quantized cache only affects tokens scored after it was written):
1. Fidelity: prefill a context of `context` tokens of Python's own documentation
   (`pydoc_data.topics`) into the cache, then feed the next `score_tokens` tokens one decode step at
   a time (teacher forcing) and keep the full logits of every step. Against the same run with the
   full-precision cache: mean KL(full || quantized), top-1 agreement, perplexity of the true next
   tokens and its change. `samples` such windows at different offsets run as one batch.
2. Greedy: from the same contexts, generate `score_tokens` tokens greedily; report the common
   prefix length with the full-precision cache's tokens (mean over samples).
3. Passkey: a 5-digit key hidden at depths 0..1 in filler text of 1K/2K/4K tokens (the
   Landmark/KIVI template); greedy answer; a case passes when the key is in the first 12 tokens.

Formats are written as specs: `int8`, `kivi2+rot` (Hadamard rotation), `K=int8/V=kivi2`,
`kivi2+skip=0,1` (layers in full precision), `kivi2+heads=0.25` (the most sensitive quarter of KV
heads in int8; `heads=0.25:fp8_e4m3` for another format).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

DEFAULT_FORMATS = "auto,float16,fp8_e4m3,fp8_e5m2,int8,kivi4,kivi2,kivi2+rot"
PASSKEY_HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the important information there.\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
PASSKEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "What is the pass key? The pass key is"


# --- format specs ---------------------------------------------------------------------------------


def parse_format_spec(spec: str) -> dict:
    """'kivi2+rot', 'K=int8/V=kivi2', 'kivi2+skip=0,1', 'kivi2+heads=0.25[:int8]' -> LLM(...) kwargs."""
    head, *extras = [p.strip() for p in spec.split("+")]
    opts: dict = {}
    if "=" in head:
        for item in head.replace(",", "/").split("/"):
            key, _, value = item.partition("=")
            if key.strip().lower() not in ("k", "v") or not value:
                raise ValueError(f"bad KV format spec {spec!r}: use e.g. 'K=int8/V=kivi2'")
            opts[f"kv_cache_dtype_{key.strip().lower()}"] = value.strip()
        opts["kv_cache_dtype"] = opts.get("kv_cache_dtype_k", "auto")
    else:
        opts["kv_cache_dtype"] = head
    for extra in extras:
        key, _, value = extra.partition("=")
        if key == "rot":
            opts["kv_cache_rotation"] = True
        elif key == "skip":
            opts["kv_cache_dtype_skip_layers"] = [int(x) for x in value.split(",") if x]
        elif key == "heads":
            share, _, dtype = value.partition(":")
            opts["kv_cache_head_precision"] = float(share)
            if dtype:
                opts["kv_cache_head_precision_dtype"] = dtype
        else:
            raise ValueError(f"bad KV format spec {spec!r}: extras are +rot, +skip=I,J, +heads=SHARE[:DTYPE]")
    return opts


# --- text ---------------------------------------------------------------------------------------


def corpus_ids(tokenizer, max_chars: int = 400_000) -> list[int]:
    """Token ids of Python's documentation text (`pydoc_data.topics`), deterministic."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))[:max_chars]
    return tokenizer.encode(text)


def windows(ids: list[int], context: int, score: int, samples: int, seed: int = 0) -> list[tuple[list, list]]:
    """`samples` (context, continuation) pairs at seeded offsets of the corpus."""
    rng = random.Random(seed)
    span = context + score
    if len(ids) < span + samples:
        raise ValueError(f"the corpus has {len(ids)} tokens; need {span} per sample")
    starts = sorted(rng.randrange(len(ids) - span) for _ in range(samples))
    return [(ids[s:s + context], ids[s + context:s + span]) for s in starts]


def passkey_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of a passkey prompt of about `length` tokens, the key line at `depth` (0..1)."""
    fixed = len(tokenizer.encode(PASSKEY_HEADER + PASSKEY_LINE.format(key=key) + PASSKEY_QUESTION))
    per = len(tokenizer.encode(PASSKEY_FILLER * 20)) / 20
    n = max(1, int((length - fixed) / per))
    before = int(round(n * depth))
    text = (PASSKEY_HEADER + PASSKEY_FILLER * before + PASSKEY_LINE.format(key=key)
            + PASSKEY_FILLER * (n - before) + PASSKEY_QUESTION)
    return tokenizer.encode(text)


# --- running the engine -------------------------------------------------------------------------


def run_forced(llm, forced: list[tuple[list[int], list[int]]], greedy: list[tuple[list[int], int]]):
    """Teacher-forced requests (context, targets) -> full logits [len(targets), vocab] each, and
    greedy requests (context, n) -> n tokens each, all in one engine run."""
    from kvserve.sampling_params import SamplingParams
    eng = llm.engine
    logits: dict[str, list[torch.Tensor]] = {}
    targets: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}

    def sample(rows, reqs):
        for req, row in zip(reqs, rows):
            rid = req.request_id
            if rid in targets:
                logits[rid].append(row.float().cpu())
                tok = targets[rid][len(logits[rid]) - 1]
            else:
                tok = int(row.argmax())
                tokens[rid].append(tok)
            eng.append_token(req, tok)

    ids_f, ids_g = [], []
    for ctx, tgt in forced:
        rid = eng.add_request({"prompt_token_ids": ctx}, SamplingParams(max_tokens=len(tgt), ignore_eos=True))
        logits[rid], targets[rid] = [], list(tgt)
        ids_f.append(rid)
    for ctx, n in greedy:
        rid = eng.add_request({"prompt_token_ids": ctx}, SamplingParams(max_tokens=n, ignore_eos=True))
        tokens[rid] = []
        ids_g.append(rid)
    while eng.has_unfinished_requests():
        eng.step(sample)
    return [torch.stack(logits[r]) for r in ids_f], [tokens[r] for r in ids_g]


def fidelity(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict:
    """KL(ref || got) per step, top-1 agreement and true-token NLL of both, from logits [N, V]."""
    lp_ref, lp_got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1)
    return {
        "kl": kl.tolist(),
        "top1": (ref.argmax(-1) == got.argmax(-1)).float().tolist(),
        "nll_ref": (-lp_ref.gather(1, targets[:, None])).squeeze(1).tolist(),
        "nll": (-lp_got.gather(1, targets[:, None])).squeeze(1).tolist(),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class FormatResult:
    """Quality and memory of one KV format on one model."""

    model: str
    spec: str
    description: str
    bytes_per_token: int
    tokens_fit: int
    mean_kl: float | None = None
    top1: float | None = None
    ppl: float | None = None
    ppl_ref: float | None = None
    greedy_match: float | None = None
    greedy_tokens: int = 0
    scored_tokens: int = 0
    passkey: dict = field(default_factory=dict)   # length -> accuracy
    seconds: float = 0.0

    @property
    def ppl_change(self) -> float | None:
        """Relative perplexity change against full precision."""
        return None if self.ppl is None else self.ppl / self.ppl_ref - 1


@dataclass
class EvalSettings:
    """What to run: model, formats, sizes."""

    model: str | None = None
    formats: list[str] = field(default_factory=lambda: DEFAULT_FORMATS.split(","))
    context: int = 1024
    score_tokens: int = 128
    samples: int = 2
    passkey_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    passkey_cases: int = 20
    passkey_formats: list[str] | None = None   # specs that run the passkey test (None: all)
    block_size: int = 32
    kv_cache_memory: str = "1GiB"
    budget_for_capacity: str = "1GiB"
    seed: int = 0
    dtype: str = "float32"    # model dtype; 'auto' formats store the cache in it (the reference)


def evaluate(settings: EvalSettings, log=print) -> list[FormatResult]:
    """Run the protocol for every format of `settings`; the first format is the reference
    unless it is not 'auto', in which case 'auto' runs first as the reference."""
    from kvserve.llm import LLM
    specs = list(settings.formats)
    if specs[0] != "auto":
        specs.insert(0, "auto")
    max_len = max([settings.context + settings.score_tokens, *settings.passkey_lengths]) + 64
    ref = None
    results = []
    data = None
    for spec in specs:
        t0 = time.perf_counter()
        llm = LLM(settings.model, max_model_len=max_len, block_size=settings.block_size,
                  kv_cache_memory=settings.kv_cache_memory, max_num_seqs=max(settings.passkey_cases, 8),
                  seed=settings.seed, dtype=settings.dtype, **parse_format_spec(spec))
        eng = llm.engine
        tok = eng.tokenizer
        if data is None:
            data = _make_data(tok, settings)
        forced = [(c, t) for c, t in data["windows"]] if settings.score_tokens else []
        greedy = [(c, settings.score_tokens) for c, _ in data["windows"]] if settings.score_tokens else []
        logits, gen = run_forced(llm, forced, greedy)
        res = FormatResult(eng.model_config.name, spec, eng.kv_format.description, eng.kv_bytes_per_token,
                           _tokens_fit(eng, settings.budget_for_capacity))
        if ref is None:
            ref = {"logits": logits, "greedy": gen}
        if logits:
            parts = [fidelity(r, g, torch.tensor(t)) for r, g, (_, t) in zip(ref["logits"], logits, forced)]
            kl = [x for p in parts for x in p["kl"]]
            res.mean_kl = sum(kl) / len(kl)
            res.top1 = sum(x for p in parts for x in p["top1"]) / len(kl)
            res.ppl = math.exp(sum(x for p in parts for x in p["nll"]) / len(kl))
            res.ppl_ref = math.exp(sum(x for p in parts for x in p["nll_ref"]) / len(kl))
            res.scored_tokens = len(kl)
            res.greedy_match = sum(common_prefix(a, b) for a, b in zip(ref["greedy"], gen)) / len(gen)
            res.greedy_tokens = settings.score_tokens
        passkey = data["passkey"] if settings.passkey_formats is None or spec in settings.passkey_formats else {}
        for length, cases in passkey.items():
            _, answers = run_forced(llm, [], [(ids, 12) for ids, _ in cases])
            hits = [str(key) in tok.decode(ans) for (_, key), ans in zip(cases, answers)]
            res.passkey[length] = sum(hits) / len(hits)
        res.seconds = time.perf_counter() - t0
        log(format_row(res))
        results.append(res)
        del llm, eng
    return results


def _make_data(tok, settings: EvalSettings) -> dict:
    if tok is None:
        raise ValueError("kv-quant evaluation needs a model with a tokenizer")
    ids = corpus_ids(tok)
    rng = random.Random(settings.seed)
    passkey = {}
    for length in settings.passkey_lengths:
        cases = []
        for i in range(settings.passkey_cases):
            depth = i / max(1, settings.passkey_cases - 1)
            key = rng.randrange(10000, 100000)
            cases.append((passkey_prompt(tok, length, depth, key), key))
        passkey[length] = cases
    return {"windows": windows(ids, settings.context, settings.score_tokens, settings.samples, settings.seed),
            "passkey": passkey}


def _tokens_fit(eng, budget: str) -> int:
    """Tokens a pool of `budget` bytes holds in this format (residual rows included)."""
    from kvserve.config import parse_bytes
    from kvserve.kv.formats import split_budget
    fmt = eng.kv_format
    blocks, _ = split_budget(parse_bytes(budget), eng.config.block_size, fmt.page_bytes_per_token,
                             fmt.residual_bytes_per_token, eng.config.max_num_seqs * len(eng.kv_groups),
                             min_rows=2 * len(eng.kv_groups))
    return blocks * eng.config.block_size // len(eng.kv_groups)


# --- output -------------------------------------------------------------------------------------


def fmt_num(x, digits=3, pct=False) -> str:
    """A table cell."""
    if x is None:
        return "—"
    return f"{x * 100:.{digits}f}%" if pct else f"{x:.{digits}g}"


HEADER = ["model", "format", "B/token", "tokens in 1 GiB", "mean KL", "top-1", "PPL", "ΔPPL",
          "greedy match", "passkey"]


def table_rows(results: list[FormatResult]) -> list[list[str]]:
    """Rows for HEADER."""
    rows = []
    for r in results:
        pk = " / ".join(f"{k // 1024}K {v:.0%}" if k % 1024 == 0 else f"{k} {v:.0%}" for k, v in r.passkey.items())
        rows.append([r.model, r.spec, f"{r.bytes_per_token:,}", f"{r.tokens_fit:,}", fmt_num(r.mean_kl, 2),
                     fmt_num(r.top1, 1, pct=True), fmt_num(r.ppl, 4),
                     "—" if r.ppl_change is None else f"{r.ppl_change * 100:+.2f}%",
                     "—" if r.greedy_match is None else f"{r.greedy_match:.0f}/{r.greedy_tokens}", pk or "—"])
    return rows


def format_row(r: FormatResult) -> str:
    """One progress line."""
    return " | ".join(table_rows([r])[0]) + f" | {r.seconds:.0f} s"


def register(subparsers) -> argparse.ArgumentParser:
    """Add `kvserve eval` (with the `kv-quant` evaluation) to an argparse subparsers object."""
    p = subparsers.add_parser("eval", help="measure what a KV cache setting costs in quality")
    sub = p.add_subparsers(dest="eval_command", required=True)
    q = sub.add_parser("kv-quant", help="KV cache formats against a full-precision cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_harness_args(q, DEFAULT_FORMATS, context=1024, score_tokens=128, samples=2)
    q.add_argument("--passkey-lengths", default="1024,2048,4096", help="prompt lengths ('' for none)")
    q.add_argument("--passkey-cases", type=int, default=20, help="cases per length")
    q.add_argument("--block-size", type=int, default=32)
    q.add_argument("--kv-cache-memory", default="1GiB")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model dtype; the 'auto' reference cache is stored in it")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=run)
    from kvserve.tools.evaluate_policies import register as register_kv_policy
    register_kv_policy(sub)  # `kvserve eval kv-policy`: KV eviction (docs/EVICTION.md)
    from kvserve.tools.evaluate_weights import register as register_weights
    register_weights(sub)    # `kvserve eval weights`: weight formats against float32
    return p


def add_harness_args(p: argparse.ArgumentParser, formats: str, context: int, score_tokens: int,
                     samples: int) -> None:
    """The options every teacher-forced evaluation takes: model, specs, context, scored tokens, windows."""
    p.add_argument("--model", default=None, help="GGUF, HF folder or alias (default: bundled SmolLM2)")
    p.add_argument("--formats", default=formats, help=f"comma-separated specs (default {formats})")
    p.add_argument("--context", type=int, default=context, help="tokens prefilled before scoring")
    p.add_argument("--score-tokens", type=int, default=score_tokens, help="teacher-forced and greedy tokens")
    p.add_argument("--samples", type=int, default=samples, help="windows of the corpus")


def settings_from_args(args) -> EvalSettings:
    """EvalSettings from parsed `kvserve eval kv-quant` arguments."""
    formats = _split_specs(args.formats)
    return EvalSettings(model=args.model, formats=formats, context=args.context,
                        score_tokens=args.score_tokens, samples=args.samples,
                        passkey_lengths=[int(x) for x in args.passkey_lengths.split(",") if x.strip()],
                        passkey_cases=args.passkey_cases, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, dtype=args.dtype)


def _split_specs(text: str) -> list[str]:
    """Split 'int8,kivi2+skip=0,1,kivi4' at commas that start a new spec."""
    out: list[str] = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece:
            continue
        if out and (piece.isdigit() or (out[-1].split("+")[-1].startswith("skip=") and piece[0].isdigit())):
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def run(args) -> int:
    """Entry point of `kvserve eval kv-quant`."""
    settings = settings_from_args(args)
    for spec in settings.formats:
        parse_format_spec(spec)
    print(" | ".join(HEADER) + " | time", file=sys.stderr)
    results = evaluate(settings, log=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps([asdict(r) | {"ppl_change": r.ppl_change} for r in results], indent=2))
    else:
        from kvserve.tools.plan import format_table
        print(format_table(table_rows(results), HEADER))
    return 0
