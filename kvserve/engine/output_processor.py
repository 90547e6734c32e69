"""What happens to a request after its token is sampled: append, detokenize, check stops, build outputs.

The OutputProcessor owns the groups of requests the engine reports on (a group is one user request;
with n > 1 its forks join it) and one incremental detokenizer per request. Every per-token cost is
bounded by the new text and the longest stop string, not by the length of the output so far."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from kvserve.engine.metrics import EngineStats
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import prompt_logprobs
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import RequestOutputKind


class OutputProcessor:
    """Appends sampled tokens, ends requests on stops and limits, and builds RequestOutputs.

    `release(req, status)` takes a request out of the scheduler and frees its cache (the engine's)."""

    def __init__(self, tokenizer, eos_token_ids, stats: EngineStats,
                 release: Callable[[Request, RequestStatus], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.stats = stats
        self.release = release
        self.groups: dict[str, list[Request]] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self._prompt_rows: dict[str, list[torch.Tensor]] = {}

    # ---- requests in and out ---------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Report on `req`: the head of a new group, or a fork joining its parent's group."""
        if req.index == 0:
            self.groups[req.group_id] = [req]
        else:
            self.groups[req.group_id].append(req)
        self.detoks[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End `req` with `status`, free it and count it."""
        self.release(req, status)
        m, n = req.metrics, req.num_output_tokens
        tpot = None
        if n > 1 and m.first_token_time is not None:
            tpot = (m.last_token_time - m.first_token_time) / (n - 1)
        self.stats.record_finished(status.value, m.ttft, tpot, m.finished_time - m.arrival_time, m.queue_time)

    def fail(self, req: Request, error: str, prefix_fault: bool = False) -> None:
        """End the whole group of `req` with an error (finish reason 'abort'); `prefix_fault`: a cached
        prefix it read was at fault, not the engine."""
        for r in self.groups.get(req.group_id, [req]):
            r.error, r.prefix_fault = error, prefix_fault
            if not r.is_finished:
                self.finish(r, RequestStatus.FINISHED_ABORTED)

    def abort(self, group_id: str) -> RequestOutput | None:
        """End every request of the group now; its final output (None for an unknown id)."""
        if group_id not in self.groups:
            return None
        for req in self.groups[group_id]:
            if not req.is_finished:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
        return self.output(group_id)

    # ---- tokens ------------------------------------------------------------------------------------
    def append(self, req: Request, token: int, logprob: float, top) -> None:
        """Record a sampled token, extend the text, and finish the request on a stop or its length."""
        req.append_token(token, logprob, top)
        self.stats.generation_tokens += 1
        p = req.params
        delta = self.detoks[req.request_id].add(token)
        req.output_text.append(delta)
        n_out = req.num_output_tokens
        if delta and p.stop and self._stop_string(req, len(delta)):
            self.finish(req, RequestStatus.FINISHED_STOPPED)
        elif n_out >= p.min_tokens and ((token in self.eos_token_ids and not p.ignore_eos)
                                        or token in p.stop_token_ids):
            req.stop_reason = token if token in p.stop_token_ids else None
            self.finish(req, RequestStatus.FINISHED_STOPPED)
        elif n_out >= p.max_tokens:  # make_request fits max_tokens to max_model_len (streams may run past)
            self.finish(req, RequestStatus.FINISHED_LENGTH)

    def _stop_string(self, req: Request, new_len: int) -> bool:
        """Cut the text at a stop string ending in the new text; True if one did."""
        p, text = req.params, req.output_text
        tail_len = new_len + max(len(s) for s in p.stop) - 1
        tail = text.since(len(text) - tail_len)
        stop = find_stop(tail, new_len, p.stop, p.include_stop_str_in_output)
        if stop is None:
            return False
        keep, req.stop_reason = stop
        text.truncate(len(text) - len(tail) + keep)
        return True

    def collect_prompt_logprobs(self, prompt_logits: dict, reqs: list[Request]) -> None:
        """Keep each request's prompt logits chunk by chunk; turn them into logprobs once the prompt is done."""
        for req in reqs:
            rows = prompt_logits.get(req.request_id)
            if rows is None:
                continue
            chunks = self._prompt_rows.setdefault(req.request_id, [])
            chunks.append(rows)
            if req.num_computed_tokens >= req.num_prompt_tokens:
                del self._prompt_rows[req.request_id]
                req.prompt_logprobs = prompt_logprobs(torch.cat(chunks), req.prompt_token_ids,
                                                      req.params.prompt_logprobs)

    # ---- outputs -----------------------------------------------------------------------------------
    def outputs(self, group_ids) -> list[RequestOutput]:
        """Outputs of the groups that moved, as their output kinds ask (a FINAL_ONLY group reports once)."""
        return [self.output(gid) for gid in group_ids if gid in self.groups and self._reports(gid)]

    def finished(self, group_id: str) -> bool:
        """True once every completion of the group has ended."""
        members = self.groups[group_id]
        head = members[0]
        return all(r.is_finished for r in members) and (
            len(members) == head.params.n or head.status == RequestStatus.FINISHED_ABORTED)

    def _reports(self, group_id: str) -> bool:
        """False for a FINAL_ONLY request still running: its step makes no output."""
        kind = self.groups[group_id][0].params.output_kind
        return kind != RequestOutputKind.FINAL_ONLY or self.finished(group_id)

    def output(self, group_id: str) -> RequestOutput:
        """The group's output now; a finished group is forgotten."""
        members = self.groups[group_id]
        head = members[0]
        outs = [completion(r) for r in members]
        finished = self.finished(group_id)
        out = RequestOutput(group_id, head.prompt, head.prompt_token_ids, outs, finished,
                            head.num_cached_tokens, head.prompt_logprobs, head.metrics, head.error,
                            head.prefix_fault, head.kv_transfer_params)
        if finished:
            self._drop(group_id)
        return out

    def _drop(self, group_id: str) -> None:
        for r in self.groups.pop(group_id, []):
            self.detoks.pop(r.request_id, None)
            self._prompt_rows.pop(r.request_id, None)


def completion(req: Request) -> CompletionOutput:
    """One completion as the request's output kind asks: everything so far (CUMULATIVE, FINAL_ONLY)
    or what is new since its last output (DELTA: no copy of what was already reported; text that may
    begin a stop string waits until the next output proves it does not)."""
    if req.params.output_kind != RequestOutputKind.DELTA:
        return CompletionOutput(req.index, req.text, list(req.output_token_ids), req.cumulative_logprob,
                                req.logprobs, req.finish_reason(), req.stop_reason)
    t, c = req.num_sent_tokens, req.num_sent_chars
    end = len(req.output_text)
    if req.finish_reason() is None:
        end -= stop_holdback(req.params)
    text = req.output_text.since(c)[:end - c] if end > c else ""
    req.num_sent_tokens, req.num_sent_chars = req.num_output_tokens, max(c, end)
    logprobs = req.logprobs[t:] if req.logprobs is not None else None
    return CompletionOutput(req.index, text, req.output_token_ids[t:],
                            req.cumulative_logprob, logprobs, req.finish_reason(), req.stop_reason)


def stop_holdback(params) -> int:
    """Characters a running DELTA output holds back: the start of a stop string that the finished,
    stop-truncated text will not contain (the longest stop string less one character), so the
    deltas add up to the final text exactly."""
    if params.include_stop_str_in_output or not params.stop:
        return 0
    return max(len(s) for s in params.stop) - 1
