"""Beam search over the engine's step: beams are requests that share KV blocks copy-on-write.

Each engine step hands the beams' logits to `BeamSearch.take`; once every live beam has its
next-token log-probs, the best continuations fork from their beams (engine.fork) and the old
beams are released (engine.release)."""

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
    root = engine.make_request(prompt, sp)
    search = BeamSearch(engine, root, params)
    engine.admit(root)
    try:
        while search.live:
            ran = search.steps
            engine.step(search.take)
            if search.steps == ran:
                raise RuntimeError("beam search stalled: the KV pool cannot hold the beams")
        return search.output()
    finally:
        for r in search.live:
            if not r.is_finished:
                engine.release(r, RequestStatus.FINISHED_ABORTED)


class BeamSearch:
    """The live beams, the finished ones, and the log-probs gathered for the next expansion."""

    def __init__(self, engine, root: Request, params: BeamSearchParams):
        self.engine, self.root, self.params = engine, root, params
        self.eos = set(engine.sampler.eos_token_ids)
        self.live: list[Request] = [root]
        self.done: list[tuple[Request, str]] = []
        self.logprobs: dict[str, torch.Tensor] = {}
        self.steps = 0         # engine steps that ran
        self.num_forks = 0

    def take(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """The engine's sample function: keep the rows, expand once every live beam has one."""
        self.steps += 1
        for req, row in zip(reqs, torch.log_softmax(logits, dim=-1)):
            self.logprobs[req.request_id] = row
        if len(self.logprobs) == len(self.live):
            self._expand()
            self.logprobs = {}

    def _expand(self) -> None:
        """Keep the best `beam_width` continuations by cumulative log-prob; EOS ends a beam."""
        p = self.params
        cands = []
        for beam in self.live:
            top = torch.topk(self.logprobs[beam.request_id], 2 * p.beam_width)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                cands.append((beam.cumulative_logprob + lp, beam, tok, lp))
        cands.sort(key=lambda c: -c[0])
        new = []
        for _, parent, tok, lp in cands:
            if len(new) == p.beam_width:   # beams that end with EOS do not take a place
                break
            child = self._fork(parent, tok, lp)
            if tok in self.eos and not p.ignore_eos:
                self.engine.release(child, RequestStatus.FINISHED_STOPPED)
                self.done.append((child, "stop"))
            else:
                new.append(child)
        for beam in self.live:
            self.engine.release(beam, RequestStatus.FINISHED_STOPPED)
        self.live = new
        if self.live and self.live[0].num_output_tokens >= p.max_tokens:
            self.done.extend((r, "length") for r in self.live)
            self.end_live()

    def _fork(self, parent: Request, token: int, logprob: float) -> Request:
        self.num_forks += 1
        child = self.engine.fork(parent, f"{self.root.request_id}/{self.num_forks}")
        child.append_token(token, logprob, None)
        return child

    def end_live(self) -> None:
        """Release the beams still running (they stay listed in `done` if they were kept)."""
        for r in self.live:
            if not r.is_finished:
                self.engine.release(r, RequestStatus.FINISHED_LENGTH)
        self.live = []

    def output(self) -> BeamSearchOutput:
        """The best `beam_width` sequences by length-normalised score."""
        p, tok = self.params, self.engine.tokenizer
        seqs = []
        for req, reason in self.done:
            toks = req.output_token_ids
            score = beam_score(req.num_tokens, req.cumulative_logprob, p.length_penalty, reason == "stop")
            text = tok.decode(toks) if tok is not None else ""
            seqs.append(BeamSearchSequence(toks, text, req.cumulative_logprob, score, reason))
        seqs.sort(key=lambda s: -s.score)
        return BeamSearchOutput(self.root.prompt, self.root.prompt_token_ids, seqs[:p.beam_width])
