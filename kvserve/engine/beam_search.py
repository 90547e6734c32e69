"""Beam search over the engine: beams are requests that share KV blocks copy-on-write."""

from __future__ import annotations

import torch

from kvserve.engine.request import Request, RequestStatus
from kvserve.outputs import BeamSearchOutput, BeamSearchSequence
from kvserve.sampling_params import BeamSearchParams, SamplingParams


def beam_score(num_tokens: int, cum_logprob: float, length_penalty: float, ends_with_eos: bool) -> float:
    """Length-normalised score (vLLM/HF convention; EOS not counted in the length)."""
    length = num_tokens - 1 if ends_with_eos else num_tokens
    return cum_logprob / (length ** length_penalty)


def run_beam_search(engine, prompt, params: BeamSearchParams) -> BeamSearchOutput:
    """Search with `params.beam_width` beams for `params.max_tokens` steps."""
    if engine.has_unfinished_requests():
        raise RuntimeError("beam_search needs an idle engine; finish or abort other requests first")
    sp = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=params.ignore_eos)
    root = engine.make_request(prompt, sp, request_id=f"beam-{next(engine._ids)}")
    if root.kv_policy is not None:
        engine.evictor.add(root, root.kv_policy)   # every beam evicts on its own (forks copy the state)
    engine.scheduler.add(root)
    eos = set(engine.sampler.eos_token_ids)
    live, done = [root], []
    try:
        for step in range(params.max_tokens):
            logprobs = _logprobs_of(engine, live)
            live, finished = _select(engine, live, logprobs, params, eos, step)
            done.extend(finished)
            if not live:
                break
        done.extend((r, "length") for r in live)
        return _output(engine, root, done, params)
    finally:
        for r in live:
            if not r.is_finished:
                _end(engine, r, RequestStatus.FINISHED_ABORTED)


def _logprobs_of(engine, beams: list[Request]) -> dict[str, torch.Tensor]:
    """Run steps until every live beam has next-token log-probs."""
    out: dict[str, torch.Tensor] = {}
    while len(out) < len(beams):
        sched = engine.scheduler.schedule()
        if not sched.scheduled:
            raise RuntimeError("beam search stalled: the KV pool cannot hold the beams")
        inp, logits, _ = engine.runner.execute(sched.scheduled)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
            if engine.kv is not None:
                engine.kv.cache_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
        engine.evictor.after_step(sched.scheduled)
        for req, row in zip(inp.sampling_reqs, torch.log_softmax(logits, dim=-1)):
            out[req.request_id] = row
    return out


def _select(engine, live, logprobs, params, eos, step):
    """Keep the best `beam_width` continuations by cumulative log-prob; EOS ends a beam."""
    k = 2 * params.beam_width
    cands = []
    for beam in live:
        top = torch.topk(logprobs[beam.request_id], k)
        for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
            cands.append((beam.cumulative_logprob + lp, beam, tok, lp))
    cands.sort(key=lambda c: -c[0])
    new, finished = [], []
    for total, parent, tok, lp in cands:
        if len(new) == params.beam_width:
            break
        child = _fork(engine, parent, tok, lp)
        if tok in eos and not params.ignore_eos:
            _end(engine, child, RequestStatus.FINISHED_STOPPED)
            finished.append((child, "stop"))
        else:
            new.append(child)
    for beam in live:
        _end(engine, beam, RequestStatus.FINISHED_STOPPED)
    return new, finished


def _end(engine, req: Request, status: RequestStatus) -> None:
    engine.scheduler.finish(req, status)
    engine.evictor.drop(req.request_id)


def _fork(engine, parent: Request, token: int, logprob: float) -> Request:
    child = Request(f"{parent.group_id}/{next(engine._ids)}", parent.prompt_token_ids, parent.params,
                    prompt=parent.prompt, group_id=parent.group_id)
    child.token_ids = parent.token_ids + [token]
    child.output_token_ids = parent.output_token_ids + [token]
    child.cumulative_logprob = parent.cumulative_logprob + logprob
    engine.evictor.fork(parent, child)
    if engine.kv is not None and parent.status != RequestStatus.RUNNING:  # parent was preempted: recompute
        child.status = RequestStatus.PREEMPTED
        engine.scheduler.waiting.append(child)
        return child
    child.num_computed_tokens = parent.num_computed_tokens
    child.status = RequestStatus.RUNNING
    if engine.kv is not None:
        engine.kv.fork(parent.request_id, child.request_id)
    engine.scheduler.running.append(child)
    return child


def _output(engine, root, done, params) -> BeamSearchOutput:
    seqs = []
    for req, reason in done:
        toks = req.output_token_ids
        score = beam_score(req.num_tokens, req.cumulative_logprob, params.length_penalty, reason == "stop")
        text = engine.tokenizer.decode(toks) if engine.tokenizer is not None else ""
        seqs.append(BeamSearchSequence(toks, text, req.cumulative_logprob, score, reason))
    seqs.sort(key=lambda s: -s.score)
    return BeamSearchOutput(root.prompt, root.prompt_token_ids, seqs[:params.beam_width])
