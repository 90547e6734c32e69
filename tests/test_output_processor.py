"""OutputProcessor and TextBuffer without a model: tokens in, text, stops and outputs out, with
per-token work bounded by the new text (the whole output is never joined for a DELTA request)."""

import time

from kvserve.engine.detokenizer import TextBuffer, find_stop
from kvserve.engine.metrics import EngineStats
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.request import Request, RequestStatus
from kvserve.sampling_params import RequestOutputKind, SamplingParams

EOS = 0


class Letters:
    """Token i decodes to the letter chr(ord('a') + i - 1); token 0 is EOS (empty text)."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i - 1) for i in ids if i != EOS)


def _tokens(word: str) -> list[int]:
    return [ord(c) - ord("a") + 1 for c in word]


def _processor():
    released = []

    def release(req, status):   # what the engine's release does to the request itself
        req.status = status
        req.metrics.finished_time = time.monotonic()
        released.append(req.request_id)
    return OutputProcessor(Letters(), [EOS], EngineStats(), release), released


def _run(params: SamplingParams, word: str, rid: str = "r"):
    proc, released = _processor()
    req = Request(rid, [1, 2, 3], params)
    proc.add(req)
    outs = []
    for tok in _tokens(word):
        if req.is_finished:
            break
        proc.append(req, tok, -0.5, None)
        outs += proc.outputs([req.group_id])
    return req, outs, released


def test_text_buffer_reads_and_cuts_across_pieces():
    buf = TextBuffer()
    for piece in ["ab", "", "cde", "f", "ghij"]:
        buf.append(piece)
    assert len(buf) == 10 and len(buf.parts) == 4          # empty pieces are not kept
    assert buf.since(3) == "defghij" and buf.since(10) == "" and buf.since(-5) == "abcdefghij"
    buf.truncate(4)
    assert buf.text() == "abcd" and len(buf) == 4
    buf.append("xy")
    assert buf.text() == "abcdxy" and buf.parts == ["abcdxy"]


def test_find_stop_matches_only_stops_ending_in_the_new_text():
    assert find_stop("hello world", 3, ["world"], False) == (6, "world")
    assert find_stop("hello world", 3, ["world"], True) == (11, "world")
    assert find_stop("hello world!", 1, ["world"], False) is None   # ended before the new text
    assert find_stop("abcabc", 2, ["bc", "ca"], False) == (4, "bc")


def test_stop_string_spanning_tokens_cuts_the_text():
    req, outs, released = _run(SamplingParams(max_tokens=20, stop=["cde"]), "abcdefgh")
    assert req.text == "ab" and req.stop_reason == "cde"
    assert req.status == RequestStatus.FINISHED_STOPPED and released == ["r"]
    assert req.output_token_ids == _tokens("abcde")           # the stop's tokens stay generated
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"


def test_stop_string_kept_when_asked():
    req, _, _ = _run(SamplingParams(max_tokens=20, stop=["xyz", "de"], include_stop_str_in_output=True),
                     "abcdefgh")
    assert req.text == "abcde" and req.stop_reason == "de"
    req, _, _ = _run(SamplingParams(max_tokens=20, stop=["bc", "zzzz"]), "abcd")   # longer stop than text
    assert req.text == "a" and req.stop_reason == "bc"


def test_eos_stop_token_and_length():
    req, _, _ = _run(SamplingParams(max_tokens=20), "ab" + "\x60" + "cd")   # "\x60" is token 0: EOS
    assert req.output_token_ids == [1, 2, EOS] and req.finish_reason() == "stop" and req.stop_reason is None
    req, _, _ = _run(SamplingParams(max_tokens=20, stop_token_ids=[3]), "abcd")
    assert req.text == "abc" and req.stop_reason == 3
    req, outs, _ = _run(SamplingParams(max_tokens=4), "abcdefgh")
    assert req.text == "abcd" and req.finish_reason() == "length" and outs[-1].finished


def test_delta_outputs_never_join_the_whole_text():
    word = "abcdefghijklmnopqrstuvwxy" * 40
    req, outs, _ = _run(SamplingParams(max_tokens=len(word), output_kind=RequestOutputKind.DELTA,
                                       stop=["zz"]), word)
    assert len(outs) == len(word) and outs[-1].finished
    assert len(req.output_text.parts) == len(word)             # one piece per token, never joined
    assert "".join(o.outputs[0].text for o in outs) == word
    assert [t for o in outs for t in o.outputs[0].token_ids] == _tokens(word)


def test_final_only_reports_once_and_the_group_is_forgotten():
    proc, _ = _processor()
    req = Request("f", [1], SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY))
    proc.add(req)
    seen = []
    for tok in _tokens("abc"):
        proc.append(req, tok, 0.0, None)
        seen += proc.outputs(["f"])
    assert len(seen) == 1 and seen[0].finished and seen[0].outputs[0].text == "abc"
    assert "f" not in proc.groups and "f" not in proc.detoks


def test_fail_ends_every_fork_of_the_group():
    proc, released = _processor()
    head = Request("g", [1], SamplingParams(max_tokens=5, n=2))
    proc.add(head)
    child = head.fork("g#1", index=1)
    proc.add(child)
    proc.fail(child, "boom")
    assert released == ["g", "g#1"]
    out = proc.output("g")
    assert out.finished and out.error == "boom"
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]


def test_delta_outputs_hold_back_what_may_begin_a_stop_string():
    """A running DELTA output never sends text that the stop-truncated final text drops: the deltas,
    added up by DeltaCollector, give exactly the CUMULATIVE output."""
    from kvserve.outputs import DeltaCollector
    word = "abcdexyzfgh"
    for stop in (["xyz"], ["xyq", "fg"], ["q"]):
        _, full, _ = _run(SamplingParams(max_tokens=len(word), stop=stop), word)
        _, deltas, _ = _run(SamplingParams(max_tokens=len(word), stop=stop,
                                           output_kind=RequestOutputKind.DELTA), word)
        final = full[-1].outputs[0]
        sent = ""
        for o in deltas:
            sent += o.outputs[0].text
            assert final.text.startswith(sent), (stop, sent)      # nothing sent is taken back
        collected = DeltaCollector()
        for o in deltas:
            collected.add(o)
        got = collected.result().outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (final.text, final.token_ids, final.finish_reason)
    assert final.text == word and final.finish_reason == "length"              # stop "q" never matched
