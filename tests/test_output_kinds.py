"""Output kinds (vLLM's RequestOutputKind): DELTA outputs add up to the CUMULATIVE one, FINAL_ONLY
reports once, and LLM.generate asks for FINAL_ONLY so running requests build no outputs."""

import pytest

from kvserve import RequestOutputKind, SamplingParams

PROMPT = "List three colours of the rainbow:"


def _run(engine, kind, rid):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, output_kind=kind)
    engine.add_request(PROMPT, params, rid)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_delta_outputs_add_up_to_the_cumulative_output(llm):
    full = _run(llm.engine, RequestOutputKind.CUMULATIVE, "cumulative")
    deltas = _run(llm.engine, RequestOutputKind.DELTA, "delta")
    final = full[-1].outputs[0]
    assert len(final.token_ids) == 12 and len(deltas) == len(full)
    assert all(len(o.outputs[0].token_ids) == 1 for o in deltas)   # one new token per decode step
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final.token_ids
    assert "".join(o.outputs[0].text for o in deltas) == final.text
    assert [lp for o in deltas for lp in o.outputs[0].logprobs] == final.logprobs
    assert deltas[-1].finished and not deltas[0].finished


def test_final_only_reports_once(llm):
    full = _run(llm.engine, RequestOutputKind.CUMULATIVE, "all")
    final = _run(llm.engine, RequestOutputKind.FINAL_ONLY, "final")
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == full[-1].outputs[0].token_ids


def test_generate_builds_no_output_before_a_request_finishes(llm, monkeypatch):
    built = []
    processor = llm.engine.output_processor
    real = processor.output
    monkeypatch.setattr(processor, "output", lambda gid: built.append(gid) or real(gid))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = llm.generate([PROMPT, "Two plus two is"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [10, 10]
    assert len(built) == 2                      # one output per request, at its end
    assert params.output_kind == RequestOutputKind.CUMULATIVE   # the caller's params are not changed


@pytest.mark.parametrize("kind", [3, "delta", -1])
def test_bad_output_kind_is_refused(kind):
    with pytest.raises(ValueError, match="output_kind must be one of"):
        SamplingParams(output_kind=kind)
