"""`kvserve eval kv-policy`: what KV eviction (kv/policies.py) costs in quality, and what memory it saves.

Every configuration runs as one request with its own `kv_policy` on one engine (started with
`kv_policy="full"`, which gives every layer its own block table), so configurations share the
batch and the model weights.

1. Streaming perplexity: `stream_tokens` tokens of Python's documentation (`pydoc_data.topics`) fed
   one token at a time (the prompt is the first token, every next token is forced), so the cache is
   evicted at every step once it is full. Per budget B: window:B, sinks:4,B-4 and h2o:B/2,B/2,
   against the full cache. StreamingLLM's result to reproduce: window-only perplexity explodes once
   the first tokens are gone; four sink tokens bring it back near the full cache.
2. Long-prompt compression: passkey (the Landmark/KIVI template) and needle ("the best thing to do
   in San Francisco") prompts of L tokens, with a share r of the prompt evicted: snapkv (the question
   is the end of the prompt, inside the observation window), snapkv-qafter (the prompt is the
   context alone; it is compressed, then the question is fed token by token), h2o (half heavy,
   half recent), sinks (4 + rest) and random (the observation window + random others). Greedy answer;
   a case passes when the key (both needle phrases) appears in it.
3. Fidelity: a context of `context` tokens compressed the same ways, then `score_tokens` forced
   tokens: mean KL(full || policy) and top-1 agreement with the full cache, step by step.
4. Memory: KV bytes each request holds in the pool (its blocks x bytes per block) at its last step,
   and at most over its life.
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

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
NEEDLE_QUESTION = "\nQuestion: What is the best thing to do in San Francisco?\nAnswer: The best thing to do in San Francisco is"
NEEDLE_PHRASES = ("sandwich", "dolores park")
COMPRESSION_POLICIES = ("snapkv", "snapkv-qafter", "h2o", "sinks", "random")


# ---- jobs: one request each, forced tokens, greedy tokens, what it held ---------------------------------


@dataclass
class Job:
    """One request: a prompt, tokens forced after it, greedy tokens after those."""

    name: str
    prompt: list[int]
    policy: str
    force: list[int] = field(default_factory=list)
    generate: int = 0
    keep: str = "nll"             # what forced steps record: none | nll | logprobs
    nll: list[float] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    held_bytes: int = 0           # KV bytes held at the last step
    peak_bytes: int = 0           # ... at most

    @property
    def generated(self) -> list[int]:
        """The greedy tokens (after the forced ones)."""
        return self.tokens[len(self.force):]


def run_jobs(llm, jobs: list[Job]) -> list[Job]:
    """Run jobs to completion on one engine (batched as the scheduler sees fit)."""
    from kvserve.sampling_params import SamplingParams
    eng = llm.engine
    by_id: dict[str, Job] = {}
    block_bytes = eng.storage.bytes_per_block

    def sample(rows, reqs):
        for req, row in zip(reqs, rows):
            job = by_id[req.request_id]
            i = len(job.tokens)
            if i < len(job.force):
                tok = job.force[i]
                if job.keep != "none":
                    lp = row.float().log_softmax(-1)
                    job.nll.append(-float(lp[tok]))
                    job.top1.append(int(row.argmax()))
                    if job.keep == "logprobs":
                        job.logprobs.append(lp.to(torch.float16).cpu())
            else:
                tok = int(row.argmax())
            job.tokens.append(tok)
            held = eng.evictor.blocks_held(req.request_id) * block_bytes
            job.held_bytes, job.peak_bytes = held, max(job.peak_bytes, held)
            eng.append_token(req, tok)

    for job in jobs:
        params = SamplingParams(max_tokens=len(job.force) + job.generate, ignore_eos=True,
                                kv_policy=job.policy)
        by_id[eng.add_request({"prompt_token_ids": job.prompt}, params)] = job
    while eng.has_unfinished_requests():
        eng.step(sample)
    return jobs


# ---- 1. streaming perplexity ------------------------------------------------------------------------------


def stream_policies(budget: int) -> list[str]:
    """The streaming configurations for one cache budget."""
    return [f"window:{budget}", f"sinks:4,{budget - 4}", f"h2o:{budget // 2},{budget - budget // 2}"]


def streaming_perplexity(llm, ids: list[int], budgets: list[int], log=print) -> list[dict]:
    """Rows {policy, budget, ppl, ppl_ratio, held_bytes, full_bytes, tokens}: the text fed one token at a time."""
    t0 = time.perf_counter()
    jobs = [Job("full", ids[:1], "full", list(ids[1:]))]
    for b in budgets:
        jobs += [Job(p, ids[:1], p, list(ids[1:])) for p in stream_policies(b)]
    run_jobs(llm, jobs)
    full = jobs[0]
    ppl_full = math.exp(sum(full.nll) / len(full.nll))
    rows = []
    for job in jobs:
        ppl = math.exp(sum(job.nll) / len(job.nll))
        budget = None if job.policy == "full" else _budget_of(job.policy)
        rows.append(dict(policy=job.policy, budget=budget, ppl=ppl, ppl_ratio=ppl / ppl_full,
                         ppl_curve=_curve(job.nll), held_bytes=job.peak_bytes, full_bytes=full.peak_bytes,
                         tokens=len(job.nll)))
    log(f"streaming perplexity: {len(ids)} tokens x {len(jobs)} configurations in {time.perf_counter() - t0:.0f} s")
    return rows


def _budget_of(spec: str) -> int:
    from kvserve.kv.policies import parse_policy
    return parse_policy(spec).capacity


def _curve(nll: list[float], points: int = 16) -> list[tuple[int, float]]:
    """Perplexity over consecutive windows of the stream: [(end token, ppl)]."""
    step = max(1, len(nll) // points)
    return [(min(i + step, len(nll)), math.exp(sum(nll[i:i + step]) / len(nll[i:i + step])))
            for i in range(0, len(nll), step)]


# ---- 2. long-prompt compression ------------------------------------------------------------------------


def policy_for(name: str, keep: int) -> str:
    """Spec of a compression configuration that keeps `keep` prompt tokens."""
    if name in ("snapkv", "snapkv-qafter"):
        return f"snapkv:{keep},32,7"
    if name == "h2o":
        return f"h2o:{keep // 2},{keep - keep // 2}"
    if name == "sinks":
        return f"sinks:4,{keep - 4}"
    if name == "random":
        return f"random:{keep},32"
    return "full"


def passkey_case(tok, length: int, depth: float, key: int) -> tuple[list[int], list[int], str]:
    """(context ids, question ids, answer) of a passkey prompt of about `length` tokens."""
    from kvserve.tools.evaluate import (
        PASSKEY_FILLER,
        PASSKEY_HEADER,
        PASSKEY_LINE,
        PASSKEY_QUESTION,
    )
    question = tok.encode(" " + PASSKEY_QUESTION)
    fixed = len(tok.encode(PASSKEY_HEADER + PASSKEY_LINE.format(key=key))) + len(question)
    per = len(tok.encode(PASSKEY_FILLER * 20)) / 20
    n = max(1, int((length - fixed) / per))
    before = int(round(n * depth))
    text = PASSKEY_HEADER + PASSKEY_FILLER * before + PASSKEY_LINE.format(key=key) + PASSKEY_FILLER * (n - before)
    return tok.encode(text), question, str(key)


def needle_case(tok, hay: list[int], length: int, depth: float) -> tuple[list[int], list[int], str]:
    """(context ids, question ids, '') of a needle in `length` tokens of documentation text."""
    needle = tok.encode(NEEDLE)
    question = tok.encode(NEEDLE_QUESTION)
    n = length - len(needle) - len(question)
    at = int(n * depth)
    return hay[:at] + needle + hay[at:n], question, ""


def passed(kind: str, answer_text: str, key: str) -> bool:
    """Passkey: the key in the answer; needle: both phrases (string_match_all)."""
    text = answer_text.lower()
    return key in text if kind == "passkey" else all(p in text for p in NEEDLE_PHRASES)


def compression_eval(llm, lengths: list[int], ratios: list[float], cases: int, policies=COMPRESSION_POLICIES,
                     kinds=("passkey", "needle"), seed: int = 0, log=print) -> list[dict]:
    """Rows {kind, length, policy, evicted, accuracy, held_bytes, full_bytes}."""
    from kvserve.tools.evaluate import corpus_ids
    tok = llm.get_tokenizer()
    rng = random.Random(seed)
    hay = corpus_ids(tok)
    rows = []
    for kind in kinds:
        for length in lengths:
            t0 = time.perf_counter()
            jobs: list[tuple[Job, str, str, float]] = []
            for i in range(cases):
                depth = ((i + 0.5) / cases + 0.382 * seed) % 1.0   # another seed: other depths too
                if kind == "passkey":
                    ctx, q, key = passkey_case(tok, length, depth, rng.randrange(10000, 100000))
                else:
                    start = rng.randrange(len(hay) - length)
                    ctx, q, key = needle_case(tok, hay[start:], length, depth)
                gen = 12 if kind == "passkey" else 24
                jobs.append((Job("full", ctx + q, "full", generate=gen, keep="none"), key, "full", 0.0))
                for r in ratios:
                    for name in policies:
                        if name == "snapkv-qafter":
                            keep = max(40, int(len(ctx) * (1 - r)))
                            job = Job(name, ctx, policy_for(name, keep), force=q, generate=gen, keep="none")
                        else:
                            keep = max(40, int((len(ctx) + len(q)) * (1 - r)))
                            job = Job(name, ctx + q, policy_for(name, keep), generate=gen, keep="none")
                        jobs.append((job, key, name, r))
            run_jobs(llm, [j for j, *_ in jobs])
            groups: dict[tuple[str, float], list] = {}
            for job, key, name, r in jobs:
                groups.setdefault((name, r), []).append((job, key))
            full_bytes = max(j.held_bytes for j, _ in groups[("full", 0.0)])
            for (name, r), members in groups.items():
                hits = [passed(kind, tok.decode(j.generated), key) for j, key in members]
                rows.append(dict(kind=kind, length=length, policy=name, evicted=r,
                                 accuracy=sum(hits) / len(hits), cases=len(hits), seeds=[seed],
                                 held_bytes=max(j.held_bytes for j, _ in members), full_bytes=full_bytes))
            log(f"{kind} {length}: " + ", ".join(f"{row['policy']}@{row['evicted']:.0%}={row['accuracy']:.0%}"
                                                for row in rows[-len(groups):])
                + f" ({time.perf_counter() - t0:.0f} s)")
    return rows


# ---- 3. fidelity --------------------------------------------------------------------------------------------


def fidelity_eval(llm, ids: list[int], context: int, score_tokens: int, ratios: list[float],
                  policies=("snapkv", "h2o", "sinks", "random"), log=print) -> list[dict]:
    """Rows {policy, evicted, mean_kl, top1, held_bytes, full_bytes}: `context` tokens compressed, then
    `score_tokens` forced tokens scored against the full cache."""
    t0 = time.perf_counter()
    ctx, cont = ids[:context], ids[context:context + score_tokens]
    jobs = [Job("full", ctx, "full", list(cont), keep="logprobs")]
    for r in ratios:
        keep = int(context * (1 - r))
        jobs += [Job(f"{p}@{r}", ctx, policy_for(p, keep), list(cont), keep="logprobs") for p in policies]
    run_jobs(llm, jobs)
    ref = torch.stack(jobs[0].logprobs).float()
    rows = []
    for job in jobs[1:]:
        lp = torch.stack(job.logprobs).float()
        kl = (ref.exp() * (ref - lp)).sum(-1)
        agree = sum(a == b for a, b in zip(job.top1, jobs[0].top1)) / len(job.top1)
        name, r = job.name.split("@")
        rows.append(dict(policy=name, evicted=float(r), mean_kl=float(kl.mean()), top1=agree,
                         held_bytes=job.held_bytes, full_bytes=jobs[0].held_bytes))
    log(f"fidelity: {len(jobs)} requests in {time.perf_counter() - t0:.0f} s")
    return rows


# ---- the command ------------------------------------------------------------------------------------------


@dataclass
class PolicyEvalSettings:
    """What to run."""

    model: str | None = None
    stream_tokens: int = 4096
    budgets: list[int] = field(default_factory=lambda: [256, 512])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    ratios: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    cases: int = 4
    context: int = 2048
    score_tokens: int = 64
    kv_cache_memory: str = "1GiB"
    max_num_seqs: int = 16
    parts: list[str] = field(default_factory=lambda: ["stream", "compression", "fidelity"])
    dtype: str = "float32"
    seed: int = 0                 # compression cases: passkeys, haystack offsets and depths


def make_llm(s: PolicyEvalSettings, max_len: int):
    """An engine with per-layer block tables and no eviction by default (requests bring their policy)."""
    from kvserve.llm import LLM
    return LLM(s.model, max_model_len=max_len, kv_cache_memory=s.kv_cache_memory, max_num_seqs=s.max_num_seqs,
               kv_policy="full", enable_prefix_caching=False, dtype=s.dtype)


def evaluate_policies(s: PolicyEvalSettings, log=print) -> dict:
    """Run the parts of the protocol `s.parts` names; returns their rows."""
    from kvserve.tools.evaluate import corpus_ids
    max_len = max([s.stream_tokens, s.context + s.score_tokens, *s.lengths]) + 64
    llm = make_llm(s, max_len)
    out: dict = {"model": llm.model_config.name, "settings": asdict(s)}
    ids = corpus_ids(llm.get_tokenizer())
    if "stream" in s.parts:
        out["stream"] = streaming_perplexity(llm, ids[:s.stream_tokens], s.budgets, log)
    if "compression" in s.parts:
        out["compression"] = compression_eval(llm, s.lengths, s.ratios, s.cases, seed=s.seed, log=log)
    if "fidelity" in s.parts:
        start = len(ids) // 3
        out["fidelity"] = fidelity_eval(llm, ids[start:], s.context, s.score_tokens, s.ratios, log=log)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def register(sub) -> argparse.ArgumentParser:
    """Add `kv-policy` to the `kvserve eval` subcommands."""
    p = sub.add_parser("kv-policy", help="KV eviction policies against the full cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF, HF folder or alias (default: bundled SmolLM2)")
    p.add_argument("--parts", default="stream,compression,fidelity", help="which parts to run")
    p.add_argument("--stream-tokens", type=int, default=4096)
    p.add_argument("--budgets", default="256,512", help="streaming cache budgets (tokens)")
    p.add_argument("--lengths", default="1024,2048,4096", help="passkey / needle prompt lengths")
    p.add_argument("--ratios", default="0.25,0.5,0.75", help="shares of the prompt evicted")
    p.add_argument("--cases", type=int, default=4, help="cases per kind and length (depths spread over the prompt)")
    p.add_argument("--context", type=int, default=2048, help="fidelity: tokens prefilled and compressed")
    p.add_argument("--score-tokens", type=int, default=64, help="fidelity: forced tokens scored")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--seed", type=int, default=0, help="compression: another seed draws other cases")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """Entry point of `kvserve eval kv-policy`."""
    s = PolicyEvalSettings(model=args.model, stream_tokens=args.stream_tokens, budgets=_ints(args.budgets),
                           lengths=_ints(args.lengths), ratios=[float(x) for x in args.ratios.split(",") if x],
                           cases=args.cases, context=args.context, score_tokens=args.score_tokens,
                           kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                           parts=[x.strip() for x in args.parts.split(",") if x.strip()], dtype=args.dtype,
                           seed=args.seed)
    out = evaluate_policies(s, log=lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name, rows in out.items():
            if isinstance(rows, list):
                print(f"## {name}")
                for row in rows:
                    print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items() if k != "ppl_curve"))
    return 0
