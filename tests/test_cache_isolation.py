"""Prefix-cache isolation and accounting: cache salts, the block hash algorithm, cached-token usage,
block timing metrics and the server's --cache-isolation modes.

Salts go into the first block's hash, so every assertion here is about which requests can find
which blocks (cached_tokens, hits), never about timing. The server tests run the app in this
process on a loopback port over the session's shared engine (no extra model load).
"""

from __future__ import annotations

import hashlib
import struct
import sys
import uuid

import httpx
import pytest
from test_server_hardening import serving
from test_tiers import run_request, tiered_cache

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.options import engine_options
from kvserve.kv.hashing import hash_full_blocks, namespace_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.tiers import CpuTier, tier_namespace
from kvserve.server.app import build_app, tenant_salt

openai = pytest.importorskip("openai")
xxhash = pytest.importorskip("xxhash")  # in the dev extra

NS = namespace_hash("unit-model", "isolation")
PROMPT = list(range(100, 117))            # 4 full blocks of 4 tokens + 1
GREEDY = SamplingParams(temperature=0, max_tokens=2)
DOC = ("A shared system prompt that many tenants send word for word, so a prefix cache would "
       "happily reuse its blocks between them unless they are kept apart. ") * 5


def admit(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None) -> int:
    """Admit, compute and free one request as the scheduler and engine would; its cached tokens."""
    kv.set_salt(rid, salt)
    hits, num_hit = kv.get_computed_blocks(rid, tokens)
    assert kv.allocate_slots(rid, num_hit, len(tokens) - num_hit, hits)
    kv.record_prefix_query(len(tokens), num_hit, hits)
    kv.cache_blocks(rid, tokens, len(tokens))
    kv.free(rid)
    kv.drop_salt(rid)
    return num_hit


# ---- hashes and the manager ------------------------------------------------------------------
def test_a_salt_changes_the_whole_chain_from_the_first_block():
    plain = hash_full_blocks(NS, PROMPT, 4)
    a = hash_full_blocks(NS, PROMPT, 4, salt="tenant-a")
    b = hash_full_blocks(NS, PROMPT, 4, salt="tenant-b")
    assert len(plain) == len(a) == len(b) == 4
    assert all(x != y and y != z and x != z for x, y, z in zip(plain, a, b))
    assert hash_full_blocks(NS, PROMPT, 4, salt="tenant-a") == a          # deterministic
    assert hash_full_blocks(NS, PROMPT, 4, salt="") == plain              # empty = no salt
    # only block 0 takes the salt: from block 1 on the chain is the plain recipe over a salted parent
    assert a[1] == hashlib.sha256(a[0] + struct.pack("<4q", *PROMPT[4:8])).digest()


def test_two_salts_never_share_blocks():
    kv = KVCacheManager(32, 4, NS)
    assert admit(kv, "a1", PROMPT, "tenant-a") == 0
    assert admit(kv, "b1", PROMPT, "tenant-b") == 0      # same tokens, other salt: no block found
    assert admit(kv, "u1", PROMPT) == 0                  # nor without a salt
    assert admit(kv, "a2", PROMPT, "tenant-a") == 16     # the same salt gets the hit
    assert admit(kv, "b2", PROMPT, "tenant-b") == 16
    assert admit(kv, "u2", PROMPT) == 16
    assert kv.pool.num_cached == 3 * 4                   # three copies of the same four blocks
    assert kv.salts == {}


def test_a_forked_child_keeps_its_parents_salt():
    kv = KVCacheManager(32, 4, NS)
    kv.set_salt("p", "tenant-a")
    hits, n = kv.get_computed_blocks("p", PROMPT[:3])
    assert kv.allocate_slots("p", n, 3, hits)
    kv.fork("p", "c")                                    # before any block is full: no hash yet
    assert kv.allocate_slots("c", 3, 5)
    kv.cache_blocks("c", PROMPT[:8], 8)
    assert kv.pool.num_cached == 2
    for rid in ("p", "c"):
        kv.free(rid)
        kv.drop_salt(rid)
    assert admit(kv, "other", PROMPT[:9], "tenant-b") == 0
    assert admit(kv, "same", PROMPT[:9], "tenant-a") == 8


def test_a_tier_entry_under_one_salt_is_not_found_under_another():
    tier = CpuTier(1 << 20)
    kv, storage, _ = tiered_cache([tier])
    kv.set_salt("a", "tenant-a")
    run_request(kv, storage, "a", PROMPT, seed=1)
    kv.reset_prefix_cache(offload=True)                  # a's blocks now live only in the tier
    assert tier.stats.entries_written == 4
    kv.set_salt("b", "tenant-b")
    assert run_request(kv, storage, "b", PROMPT, seed=2)[0] == 0
    assert run_request(kv, storage, "u", PROMPT, seed=3)[0] == 0   # unsalted
    assert tier.stats.hits == 0
    kv.set_salt("a2", "tenant-a")
    assert run_request(kv, storage, "a2", PROMPT, seed=4)[0] == 16
    assert tier.stats.hits == 4 and kv.stats.hits_by_source["cpu"] == 16


def test_hash_algorithms_give_different_hashes():
    sha = namespace_hash("m", 16)
    xx = namespace_hash("m", 16, algo="xxhash")
    assert sha == hashlib.sha256(b"m|16|hash=sha256").digest() and len(sha) == 32
    assert xx == xxhash.xxh3_128_digest(b"m|16|hash=xxhash") and len(xx) == 16
    blocks = hash_full_blocks(xx, PROMPT, 4, algo="xxhash")
    assert blocks[0] == xxhash.xxh3_128_digest(xx + struct.pack("<4q", *PROMPT[:4]))
    assert blocks != hash_full_blocks(xx, PROMPT, 4)     # same root, other algorithm
    kw = dict(weights="w", dtype="float32", kv_format="native", block_size=16, layer_specs="s", layout=[])
    assert tier_namespace(**kw) != tier_namespace(**kw, hash_algo="xxhash")


def test_hash_algorithm_is_checked(monkeypatch):
    with pytest.raises(ValueError, match="must be one of.*sha256.*xxhash"):
        engine_options(EngineConfig(prefix_caching_hash_algo="md5", dtype="float32"))
    monkeypatch.setitem(sys.modules, "xxhash", None)     # as if it were not installed
    with pytest.raises(ValueError, match="pip install xxhash"):
        engine_options(EngineConfig(prefix_caching_hash_algo="xxhash", dtype="float32"))
    with pytest.raises(ValueError, match="pip install xxhash"):
        KVCacheManager(8, 4, NS, hash_algo="xxhash")


def test_block_lifetime_and_reuse_gap_on_a_clock():
    kv = KVCacheManager(6, 4, NS)
    now = [0.0]
    kv.pool.clock = lambda: now[0]
    assert admit(kv, "a", PROMPT[:10]) == 0              # 2 full blocks + a partial one, freed at 0
    assert kv.pool.lifetime.count == 1                   # the partial block: nothing reusable left
    now[0] = 7.0
    hits, n = kv.get_computed_blocks("b", PROMPT[:10])
    assert n == 8 and kv.allocate_slots("b", n, 2, hits)
    assert kv.pool.reuse_gap.snapshot()["count"] == 2 and kv.pool.reuse_gap.sum == 14.0
    now[0] = 9.0
    kv.free("b")                                         # its partial block lived 2 s
    assert kv.pool.lifetime.count == 2 and kv.pool.lifetime.sum == 2.0
    now[0] = 20.0
    kv.allocate_slots("c", 0, 24)                        # all 6 blocks: evicts the 2 cached ones
    snap = kv.pool.lifetime.snapshot()
    assert snap["count"] == 4 and snap["sum"] == 2.0 + 20.0 + 20.0
    assert dict(snap["buckets"])[10.0] == 2 and dict(snap["buckets"])[30.0] == 4


# ---- engines ---------------------------------------------------------------------------------
def test_cache_salt_in_sampling_params_and_prompt_dicts(llm):
    doc = f"[{uuid.uuid4().hex}] {DOC}"
    first = llm.generate([{"prompt": doc, "cache_salt": "a"}], GREEDY, use_tqdm=False)[0]
    other = llm.generate([doc], SamplingParams(temperature=0, max_tokens=2, cache_salt="b"), use_tqdm=False)[0]
    plain = llm.generate([doc], GREEDY, use_tqdm=False)[0]
    same = llm.generate([doc], SamplingParams(temperature=0, max_tokens=2, cache_salt="a"), use_tqdm=False)[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, plain.num_cached_tokens) == (0, 0, 0)
    assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // 16 * 16 > 0
    assert same.outputs[0].token_ids == first.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")
    with pytest.raises(ValueError, match="given twice"):
        llm.generate([{"prompt": doc, "cache_salt": "a"}], SamplingParams(cache_salt="b"), use_tqdm=False)


def test_xxhash_engine_end_to_end(llm):
    doc = f"[{uuid.uuid4().hex}] {DOC}"
    fast = LLM(kv_cache_memory="32MiB", max_model_len=512, dtype="float32", prefix_caching_hash_algo="xxhash")
    outs = [fast.generate([doc], SamplingParams(temperature=0, max_tokens=2, cache_salt=s), use_tqdm=False)[0]
            for s in (None, None, "a")]
    assert [o.num_cached_tokens for o in outs] == [0, (len(outs[0].prompt_token_ids) - 1) // 16 * 16, 0]
    reference = llm.generate([doc], GREEDY, use_tqdm=False)[0]           # the sha256 engine
    assert all(o.outputs[0].token_ids == reference.outputs[0].token_ids for o in outs)
    assert {len(h) for h in fast.engine.kv.pool.cached} == {16}          # xxh3-128
    assert {len(h) for h in llm.engine.kv.pool.cached} == {32}           # sha256


# ---- the server ------------------------------------------------------------------------------
def _metrics(url: str, headers: dict | None = None) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    return {s.name + "".join(f"[{k}={v}]" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _new_blocks(usage, block_size: int = 16) -> int:
    """Blocks a finished request allocated: all it computed (the last token never is) less its hits."""
    computed = usage.prompt_tokens + usage.completion_tokens - 1
    return -(-computed // block_size) - usage.prompt_tokens_details.cached_tokens // block_size


def _chat_stream_usage(client, doc: str, salt: str | None):
    extra = {"cache_salt": salt} if salt else None
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": doc}], max_tokens=2, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert chunks[-1].choices == []
    return chunks[-1].usage


def test_cached_tokens_salts_and_metrics_over_http(llm):
    doc = f"[{uuid.uuid4().hex}] {DOC}"
    with serving(build_app(llm.engine, served_model_name="m")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        m0 = _metrics(url)

        def complete(salt):
            extra = {"cache_salt": salt} if salt else None
            return client.completions.create(model="m", prompt=doc, max_tokens=2, temperature=0,
                                             extra_body=extra).usage

        usages = [complete("alice"), complete("bob"), complete(None), complete("alice")]
        cached = [u.prompt_tokens_details.cached_tokens for u in usages]
        full = (usages[0].prompt_tokens - 1) // 16 * 16
        assert cached == [0, 0, 0, full] and full > 0
        streamed = [_chat_stream_usage(client, doc, s) for s in ("carol", "dave", "carol")]
        scached = [u.prompt_tokens_details.cached_tokens for u in streamed]
        assert scached == [0, 0, (streamed[0].prompt_tokens - 1) // 16 * 16] and scached[2] > 0
        m1 = _metrics(url)

    def delta(key: str) -> float:
        return m1[key] - m0.get(key, 0.0)
    total = full + scached[2]
    assert delta("kvserve:prompt_tokens_cached_total") == total
    assert delta("kvserve:prefix_cache_hits_by_source_total[source=device]") == total
    for source in ("cpu", "disk", "redis"):
        assert m1[f"kvserve:prefix_cache_hits_by_source_total[source={source}]"] == 0
    assert delta("kvserve:kv_block_reuse_gap_seconds_count") == total // 16   # every hit block sat free
    # a new block ends its life when freed without a hash (partial, or a duplicate of a cached one) or
    # when evicted; the rest stay cached: lifetimes = new blocks - the change in cached blocks
    new = sum(_new_blocks(u) for u in usages + streamed)
    assert delta("kvserve:kv_block_lifetime_seconds_count") == new - delta("kvserve:num_blocks_cached")
    assert m1["kvserve:kv_block_lifetime_seconds_bucket[le=+Inf]"] == m1["kvserve:kv_block_lifetime_seconds_count"]


def test_bad_cache_salt_gets_400(llm):
    with serving(build_app(llm.engine)) as url:
        for salt in ("", 5, ["a"]):
            r = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 1, "cache_salt": salt})
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_api_key_isolation_keeps_tenants_apart(llm):
    doc = f"[{uuid.uuid4().hex}] {DOC}"

    def cached(url: str, key: str, salt: str | None = None) -> int:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        usage = client.completions.create(model="m", prompt=doc, max_tokens=1, temperature=0,
                                          extra_body={"cache_salt": salt} if salt else None).usage
        return usage.prompt_tokens_details.cached_tokens

    app = build_app(llm.engine, served_model_name="m", api_key=["key-a", "key-b"], cache_isolation="api-key")
    with serving(app) as url:
        seen = [cached(url, "key-a"), cached(url, "key-b"), cached(url, "key-a"), cached(url, "key-b"),
                cached(url, "key-a", salt="sub")]
        with pytest.raises(openai.AuthenticationError):
            cached(url, "key-c")
    full = seen[2]
    assert full > 0 and seen == [0, 0, full, full, 0]    # each key hits only its own blocks
    with serving(build_app(llm.engine, served_model_name="m", api_key=["key-a", "key-b"])) as url:
        assert cached(url, "key-a") == 0                 # salt mode: unsalted requests share...
        assert cached(url, "key-b") == full              # ...across keys


def test_isolation_none_refuses_a_salt(llm):
    with serving(build_app(llm.engine, cache_isolation="none")) as url:
        body = {"prompt": "Hello", "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "cache_salt": "a"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "cache_salt" and "--cache-isolation none" in err["message"]


def test_cache_isolation_flags(monkeypatch):
    from kvserve.cli import build_parser
    from kvserve.server.cli import api_keys_of, cmd_serve
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b", "--api-key", "a",
                                      "--cache-isolation", "api-key", "--prefix-caching-hash-algo", "xxhash"])
    assert api_keys_of(args) == ["a", "b"] and args.prefix_caching_hash_algo == "xxhash"
    assert build_parser().parse_args(["serve"]).cache_isolation == "salt"
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    lonely = build_parser().parse_args(["serve", "--cache-isolation", "api-key"])
    with pytest.raises(ValueError, match="needs at least one --api-key"):
        cmd_serve(lonely)                                # refused before any model is loaded
    monkeypatch.setenv("KVSERVE_API_KEY", "env-key")
    assert api_keys_of(lonely) == ["env-key"]
    assert tenant_salt("sk-a") != tenant_salt("sk-b") and "sk-a" not in tenant_salt("sk-a")


def test_metrics_and_the_kv_state_need_the_admin_key_and_tenants_get_403(llm):
    def get(url: str, path: str, key: str | None) -> httpx.Response:
        return httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)

    app = build_app(llm.engine, served_model_name="m", api_key=["key-a", "key-b"], admin_api_key="adm",
                    cache_isolation="api-key")
    with serving(app) as url:
        for path in ("/metrics", "/v1/kv/state"):
            assert get(url, path, None).status_code == 401
            r = get(url, path, "key-a")
            err = r.json()["error"]
            assert r.status_code == 403 and err["code"] == "admin_key_required" and "--admin-api-key" in err["message"]
            assert get(url, path, "adm").status_code == 200
        with httpx.stream("GET", f"{url}/v1/kv/stream", headers={"Authorization": "Bearer key-b"}) as r:
            assert r.status_code == 403
        with httpx.stream("GET", f"{url}/v1/kv/stream", headers={"Authorization": "Bearer adm"}) as r:
            assert r.status_code == 200 and next(r.iter_lines()).startswith("data: {")
        assert get(url, "/v1/models", "key-a").status_code == get(url, "/v1/models", "adm").status_code == 200
        assert get(url, "/dashboard", None).status_code == 200          # the page itself holds no data
    app = build_app(llm.engine, api_key=["key-a", "key-b"], cache_isolation="api-key")   # no admin key
    with serving(app) as url:
        r = get(url, "/metrics", "key-a")
        assert r.status_code == 403 and "start the server with --admin-api-key" in r.json()["error"]["message"]
    with serving(build_app(llm.engine, api_key=["key-a", "key-b"])) as url:          # salt: one operator
        assert get(url, "/metrics", "key-a").status_code == 200
    with pytest.raises(ValueError, match="must differ from every --api-key"):
        build_app(llm.engine, api_key=["key-a"], admin_api_key="key-a")
