"""Bad input gets a clear error and the engine keeps serving."""

import pytest
from helpers import all_blocks_free
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams

OK = SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.parametrize("prompt, params, message", [
    ("", OK, "prompt is empty"),
    ([], OK, "prompt is empty"),
    ("hello " * 3000, OK, "max_model_len"),
    ("hello", SamplingParams(max_tokens=4000), "max_tokens"),
    ([10 ** 9], OK, "outside the vocabulary"),
    (3.5, OK, "a prompt must be"),
])
def test_bad_prompt_is_refused_and_engine_keeps_working(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params, use_tqdm=False)
    assert all_blocks_free(llm)
    out = llm.generate(["The capital of France is"], OK, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_one_bad_prompt_in_a_batch_adds_nothing(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], OK, use_tqdm=False)
    assert llm.get_metrics()["num_requests_waiting"] == 0
    assert all_blocks_free(llm)


@pytest.mark.parametrize("field, value", [("max_tokens", -1), ("top_p", 1.5), ("temperature", -0.1)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        LLM("/no/such/model.gguf", dtype="float32")


def test_pool_smaller_than_one_sequence_is_refused():
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(kv_cache_memory="1MiB", max_model_len=2048, dtype="float32")


def test_request_larger_than_pool_is_refused_not_hung():
    small = LLM(kv_cache_memory=8 * 16 * 46080, max_model_len=128, dtype="float32")  # 8 blocks = 128 tokens
    with pytest.raises(ValueError, match="max_model_len|KV blocks"):
        small.generate(["hi"], SamplingParams(max_tokens=200), use_tqdm=False)
    assert small.generate(["hi"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_bad_engine_options():
    with pytest.raises(ValueError, match="kv_cache_mode"):
        LLM(kv_cache_mode="weird", dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_memory|byte size"):
        LLM(kv_cache_memory="lots", dtype="float32")


def test_abort_frees_blocks_and_forgets_the_request(llm):
    eng = llm.engine
    rid = eng.add_request("The capital of France is", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    out = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert rid not in eng.groups and not eng.has_unfinished_requests()
    assert all_blocks_free(llm)
    assert eng.abort_request(rid) is None


def test_huge_seed_with_forks_does_not_crash(llm):
    out = llm.generate(["hi"], SamplingParams(n=2, seed=2**64 - 2, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs) == 2


# ---- one request must not kill the engine ------------------------------------------------------

def test_a_request_whose_logits_turn_nan_fails_alone(poisoned):
    params = [SamplingParams(max_tokens=6, ignore_eos=True, seed=s) for s in (1, 1002, 2)]
    outs = poisoned.generate(["Hello", "Hello there", "The sky is"], params, use_tqdm=False)
    fine, failed, other = outs
    assert failed.outputs[0].finish_reason == "abort" and len(failed.outputs[0].token_ids) == 2
    assert "NaN or infinite" in failed.error and "repetition_penalty" in failed.error
    assert fine.error is None and other.error is None
    assert [len(o.outputs[0].token_ids) for o in (fine, other)] == [6, 6]
    assert all_blocks_free(poisoned)


# Every field, over its range and float32's edges (5e-324, 1e-50, 3.4e38, 1e39, ...): most
# draws are valid, so they reach the engine; the validator refuses the rest.
SAMPLING_FIELDS = st.fixed_dictionaries({
    "n": st.integers(1, 3),
    "temperature": st.one_of(st.floats(0, 2), st.floats(0, 1e39)),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 2**63),
    "min_p": st.floats(0, 1),
    "seed": st.one_of(st.none(), st.integers(-2**64, 2**64)),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 2**64), max_size=3),
    "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 4),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.one_of(st.floats(1e-50, 2), st.floats(0.5, 1e39)),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "kv_policy": st.sampled_from([None, None, "window:16"]),
})


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(SAMPLING_FIELDS)
@example({"repetition_penalty": 1e-50, "temperature": 1.0, "max_tokens": 4})
@example({"temperature": 1e39, "min_tokens": 2, "max_tokens": 4})
def test_engine_survives_any_sampling_params(llm, fields):
    try:
        params = SamplingParams(**fields)
    except ValueError:
        return  # refused with a message naming the field (checked elsewhere)
    try:
        outs = llm.generate(["Hello", [1, 2, 3]], params, use_tqdm=False)
    except ValueError:
        outs = []  # refused before anything was queued, e.g. max_tokens beyond max_model_len
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert all_blocks_free(llm) and not llm.engine.has_unfinished_requests()
