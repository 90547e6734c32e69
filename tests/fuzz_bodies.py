"""Hypothesis strategies for request bodies around the OpenAI schema (tests and benchmarks/fuzz_server.py).

Each field is mostly a valid value and sometimes any JSON, so most bodies reach the engine while
wrong types, edge floats, lone surrogates and special-token text still come up.
"""

from hypothesis import strategies as st

TEXT = st.one_of(st.text(min_size=1, max_size=8),
                 st.sampled_from(["", "ab\ud800cd", "<|im_end|>", "\x00", "Hello"]))
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                        max_leaves=6)


def maybe(valid):
    """Mostly a valid value, sometimes any JSON."""
    return st.one_of(*[valid] * 12, ANY_JSON)


MESSAGE = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "developer"]))},
    optional={"content": maybe(st.one_of(TEXT, st.lists(st.fixed_dictionaries(
        {"type": maybe(st.just("text"))}, optional={"text": maybe(TEXT)}), max_size=2))),
              "name": TEXT})
SAMPLING = {
    "max_tokens": maybe(st.integers(-1, 4)),
    "n": maybe(st.integers(0, 2)),
    "temperature": maybe(st.floats(0, 1e39)),
    "top_p": maybe(st.floats(0, 1)),
    "top_k": maybe(st.integers(-2, 2**64)),
    "min_p": maybe(st.floats(0, 1)),
    "seed": maybe(st.integers(-2**64, 2**64)),
    "stop": maybe(st.lists(TEXT, max_size=2)),
    "stop_token_ids": maybe(st.lists(st.integers(-1, 2**64), max_size=2)),
    "presence_penalty": maybe(st.floats(-3, 3)),
    "frequency_penalty": maybe(st.floats(-3, 3)),
    "repetition_penalty": maybe(st.floats(0, 1e39)),
    "min_tokens": maybe(st.integers(-1, 5)),
    "ignore_eos": maybe(st.booleans()),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "gpt-4"]),
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": maybe(st.one_of(TEXT, st.lists(st.integers(-1, 50000), max_size=4),
                               st.lists(TEXT, min_size=1, max_size=2)))},
    optional={**SAMPLING, "logprobs": maybe(st.integers(-1, 21)), "echo": st.booleans()})
CHAT = st.fixed_dictionaries(
    {"messages": maybe(st.lists(MESSAGE, max_size=3))},
    optional={**SAMPLING, "logprobs": maybe(st.booleans()), "top_logprobs": maybe(st.integers(-1, 21)),
              "max_completion_tokens": maybe(st.integers(0, 4))})


def short(path: str, body: dict) -> dict:
    """Chat defaults to max_model_len new tokens: keep fuzzed requests short."""
    if path.endswith("chat/completions") and "max_tokens" not in body and "max_completion_tokens" not in body:
        return {**body, "max_tokens": 3}
    return body


CASES = st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION),
                  st.tuples(st.just("/v1/chat/completions"), CHAT))
