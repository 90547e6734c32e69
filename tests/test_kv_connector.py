"""KV connectors (kv/connector.py): a producer engine saves a finished prefill's blocks, a consumer
receives them and prefills only the last partial block; its greedy output equals the same request
run colocated. Engine to engine over TCP and through a shared disk tier, a quantized KV format, load
failures under both policies, and the options refused."""

from __future__ import annotations

import json

import pytest
from helpers import all_blocks_free

from kvserve import LLM, SamplingParams
from kvserve.kv.connector import KVLoadError, parse_kv_transfer_config

ENGINE = dict(kv_cache_memory="32MiB", max_model_len=512, dtype="float32", kv_cache_dtype="int8")
PROMPT = ("The KV cache keeps the keys and values of every past token so that a decode step reads them "
          "instead of recomputing them; paged blocks, prefix reuse and eviction all follow from that. ") * 2
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def tcp(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "TcpConnector", "kv_role": role, **extra})


def make_pair() -> tuple[LLM, LLM]:
    producer = LLM(**ENGINE, kv_transfer_config=tcp("kv_producer"))
    consumer = LLM(**ENGINE, kv_transfer_config=tcp("kv_consumer", kv_connector_extra_config={"timeout": 2}))
    return producer, consumer


@pytest.fixture(scope="module")
def pair():
    producer, consumer = make_pair()
    yield producer, consumer
    producer.close()
    consumer.close()


def prefill(llm: LLM, prompt: str = PROMPT, **params) -> dict:
    """The producer's prefill (one token), answered with the params a consumer needs."""
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                kv_transfer_params={"do_remote_decode": True}, **params),
                       use_tqdm=False)[0]
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def decode(llm: LLM, params: dict, prompt: str = PROMPT, **extra):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, kv_transfer_params=params, **extra)
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def colocated(llm: LLM, prompt: str = PROMPT, **extra):
    """The oracle: the same request on the consumer's own engine, with nothing cached."""
    llm.engine.reset_prefix_cache()
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1,
                                                 **extra), use_tqdm=False)[0]


def test_a_decode_engine_receives_the_prefill_and_decodes_as_colocated(pair):
    producer, consumer = pair
    want = colocated(consumer)
    consumer.engine.reset_prefix_cache()
    params = prefill(producer)
    n_prompt = len(want.prompt_token_ids)
    blocks = (n_prompt - 1) // 16
    assert params["do_remote_prefill"] and params["remote_num_blocks"] == blocks
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] > 0
    before = consumer.get_metrics()["prefix_cache_hits_by_source"].get("remote", 0)
    got = decode(consumer, params)
    assert got.num_cached_tokens == blocks * 16        # only the last partial block was prefilled here
    assert consumer.get_metrics()["prefix_cache_hits_by_source"]["remote"] - before == blocks * 16
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        t = next(iter(b))
        assert abs(a[t].logprob - b[t].logprob) < 1e-4
    sent = producer.get_metrics()["kv_transfer"]
    assert sent["saved_blocks"] >= blocks and sent["buffer_bytes"] == 0   # each entry left once sent
    got_m = consumer.get_metrics()["kv_transfer"]
    assert got_m["received_blocks"] >= blocks and got_m["missing_blocks"] == 0
    assert all_blocks_free(producer) and all_blocks_free(consumer)


def test_a_salted_request_receives_only_its_salts_blocks(pair):
    producer, consumer = pair
    consumer.engine.reset_prefix_cache()
    params = prefill(producer, cache_salt="tenant-a")
    other = decode(consumer, params, cache_salt="tenant-b")   # other keys: nothing arrives, it recomputes
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == colocated(consumer, cache_salt="tenant-b").outputs[0].token_ids


def test_a_producer_that_does_not_answer_recomputes_or_fails(pair, tmp_path):
    producer, consumer = pair
    want = colocated(consumer)
    consumer.engine.reset_prefix_cache()
    params = prefill(producer)
    gone = {**params, "remote_port": _closed_port()}
    failures = consumer.get_metrics()["kv_transfer"]["load_failures"]
    got = decode(consumer, gone)       # recompute policy: the whole prompt prefills here
    assert got.num_cached_tokens == 0 and got.outputs[0].token_ids == want.outputs[0].token_ids
    assert consumer.get_metrics()["kv_transfer"]["load_failures"] == failures + 1
    strict = LLM(**ENGINE, kv_transfer_config=tcp("kv_consumer", kv_load_failure_policy="fail",
                                                  kv_connector_extra_config={"timeout": 1}))
    try:
        with pytest.raises(KVLoadError, match="kv_load_failure_policy is 'fail'"):
            decode(strict, gone)
        assert not strict.engine.has_unfinished_requests() and all_blocks_free(strict)
        good = decode(strict, params)   # the engine keeps serving: the real producer's blocks arrive
        assert good.num_cached_tokens > 0 and good.outputs[0].token_ids == want.outputs[0].token_ids
    finally:
        strict.close()


def test_through_a_shared_disk_tier(tmp_path):
    cfg = {"kv_connector": "TierConnector", "kv_connector_extra_config": {"tier": f"disk:{tmp_path}:64MiB"}}
    producer = LLM(**ENGINE, kv_transfer_config={**cfg, "kv_role": "kv_producer"})
    consumer = LLM(**ENGINE, kv_transfer_config={**cfg, "kv_role": "kv_consumer"})
    try:
        want = colocated(consumer)
        consumer.engine.reset_prefix_cache()
        params = prefill(producer)
        assert "remote_host" not in params       # the tier is the meeting place
        got = decode(consumer, params)
        assert got.num_cached_tokens == (len(got.prompt_token_ids) - 1) // 16 * 16
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("config, match", [
    ('{"kv_connector": "Nope", "kv_role": "kv_both"}', "is not one of"),
    ('{"kv_connector": "TcpConnector", "kv_role": "boss"}', "kv_role"),
    ('{"kv_connector": "TcpConnector"}', "needs 'kv_role'"),
    ('{"kv_connector": "TierConnector", "kv_role": "kv_both"}', "needs kv_connector_extra_config"),
    ('{"kv_connector": "TcpConnector", "kv_role": "kv_both", "kv_load_failure_policy": "maybe"}', "recompute"),
    ('{"kv_connector": "TcpConnector", "kv_role": "kv_both", "colour": 1}', "unknown keys"),
    ("not json", "is not JSON"),
])
def test_bad_configs_say_what_to_give(config, match):
    with pytest.raises(ValueError, match=match):
        parse_kv_transfer_config(config)


def test_options_a_connector_cannot_run_with_are_refused():
    from kvserve.config import EngineConfig
    from kvserve.engine.options import engine_options
    for extra, match in (({"kv_policy": "window:64"}, "kv_policy"), ({"enable_prefix_caching": False}, "prefix"),
                         ({"kv_cache_mode": "none"}, "kv_cache_mode")):
        with pytest.raises(ValueError, match=match):
            engine_options(EngineConfig(kv_transfer_config=tcp("kv_both"), **extra))
    with pytest.raises(ValueError, match="not cpu"):
        engine_options(EngineConfig(kv_transfer_config={"kv_connector": "TierConnector", "kv_role": "kv_both",
                                                        "kv_connector_extra_config": {"tier": "cpu:1GiB"}}))


def test_transfer_params_need_a_connector(llm):
    with pytest.raises(ValueError, match="no KV connector"):
        llm.generate(["hi"], SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                     use_tqdm=False)


def _closed_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_over_http_with_the_openai_client(pair):
    """kv_transfer_params through the server (extra_body in, a body field out), as a proxy uses them;
    a request without them gets none back."""
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from kvserve.server.app import build_app
    producer, consumer = pair
    want = colocated(consumer)
    consumer.engine.reset_prefix_cache()
    ids = list(want.prompt_token_ids)
    with TestClient(build_app(producer.engine)) as p, TestClient(build_app(consumer.engine)) as c:
        first = OpenAI(base_url="http://testserver/v1", api_key="-", http_client=p).completions.create(
            model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=1, temperature=0, extra_body={"kv_transfer_params": {"do_remote_decode": True}})
        params = first.model_extra["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_num_blocks"] == (len(ids) - 1) // 16
        second = OpenAI(base_url="http://testserver/v1", api_key="-", http_client=c).completions.create(
            model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=12, temperature=0,
            extra_body={"kv_transfer_params": params, "ignore_eos": True})
        assert second.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16
        assert second.choices[0].text == want.outputs[0].text
        plain = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2})
        assert plain.status_code == 200 and plain.json().get("kv_transfer_params") is None


def test_the_proxy_prefills_on_one_server_and_decodes_on_the_other():
    """`kvserve proxy` over two real servers on loopback: the answer (streamed and not) equals the
    colocated one, the decode server prefilled only the last partial block, and the producer saved
    the blocks the consumer received. Its own pair: a server's shutdown closes its engine."""
    from helpers import serving
    from openai import OpenAI

    from kvserve.server.app import build_app
    from kvserve.server.disagg import build_proxy
    producer, consumer = make_pair()
    want = colocated(consumer)
    consumer.engine.reset_prefix_cache()
    ids = list(want.prompt_token_ids)
    saved = producer.get_metrics()["kv_transfer"]["saved_requests"]
    with serving(build_app(producer.engine)) as p_url, serving(build_app(consumer.engine)) as c_url, \
            serving(build_proxy([p_url], [c_url])) as proxy:
        client = OpenAI(base_url=f"{proxy}/v1", api_key="-")
        args = dict(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True})
        whole = client.completions.create(**args)
        assert whole.choices[0].text == want.outputs[0].text
        assert whole.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16
        consumer_cached = whole.usage.prompt_tokens_details.cached_tokens
        streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
        assert streamed == want.outputs[0].text and consumer_cached > 0
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"   # other routes: a decode server
    assert producer.get_metrics()["kv_transfer"]["saved_requests"] == saved + 2
