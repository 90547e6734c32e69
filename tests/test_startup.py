"""Start-up (engine/compile.py, server/loading.py): the compiled-artifact cache key, a second process
reading the artifacts instead of generating them, the switch from eager to compiled steps between two
steps, a failed background compile, and /health while the model loads."""

import json
import logging
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from family_checkpoints import make_tiny_checkpoint

from kvserve import LLM, SamplingParams
from kvserve.config import EAGER_ENV, EngineConfig
from kvserve.engine import compile as startup
from kvserve.engine.compile import artifact_key
from kvserve.model.regions import EAGER

# float32 activations over int8 weights: compiled, with sums close enough to eager's that greedy
# tokens agree (16-bit activations on random weights flip near-ties)
TINY = dict(dtype="float32", weights="int8", kv_cache_memory="4MiB", max_model_len=256)
PROMPT = [5, 17, 33, 8, 91, 4]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

# One process: build the tiny model compiled (blocking), report what Inductor did while it compiled
# (graphs generated: cache misses; read: hits), and greedy-decode PROMPT.
WORKER = """
import json, sys
from torch._dynamo.utils import counters
from kvserve import LLM, SamplingParams
import kvserve.engine.compile as startup
startup._sources_digest = lambda: "sources"   # both processes key alike while the tree is edited meanwhile
llm = LLM(sys.argv[1], compile_mode="blocking", **json.loads(sys.argv[2]))
built = dict(counters["inductor"])
out = llm.generate([json.loads(sys.argv[3])], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                   use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"tokens": out, "compiled": llm.engine.compiled, "misses": built.get("fxgraph_cache_miss", 0),
                  "hits": built.get("fxgraph_cache_hit", 0)}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("startup"))


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """kvserve's cache folder for this module (compiled artifacts, weights, kernels)."""
    return tmp_path_factory.mktemp("cache-home")


def _run_worker(tiny, cache_home, inductor_dir) -> dict:
    env = {**os.environ, EAGER_ENV: "0", "XDG_CACHE_HOME": str(cache_home),
           "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    done = subprocess.run([sys.executable, "-c", WORKER, tiny, json.dumps(TINY), json.dumps(PROMPT)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_and_second(tiny, cache_home, tmp_path_factory):
    """Two processes over the same kvserve cache, each with an empty Inductor cache of its own."""
    first = _run_worker(tiny, cache_home, tmp_path_factory.mktemp("inductor-1"))
    second = _run_worker(tiny, cache_home, tmp_path_factory.mktemp("inductor-2"))
    return first, second


def test_the_key_follows_model_config_torch_and_cpu(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    cfg = EngineConfig(kv_cache_memory="64MiB")
    key = artifact_key(cfg, str(model))
    assert artifact_key(EngineConfig(kv_cache_memory="64MiB"), str(model)) == key
    # the compile mode and how the model was named build the same graphs
    assert artifact_key(EngineConfig(kv_cache_memory="64MiB", compile_mode="blocking", model=str(model)),
                        str(model)) == key
    # a KV tier key is a secret that changes no graph: it stays out of the key
    assert artifact_key(EngineConfig(kv_cache_memory="64MiB", kv_tier_key="k" * 32), str(model)) == key
    changed = {
        artifact_key(EngineConfig(kv_cache_memory="128MiB"), str(model)),
        artifact_key(EngineConfig(kv_cache_memory="64MiB", max_model_len=512), str(model)),
        artifact_key(cfg, str(model), torch_version="0.0.1"),
        artifact_key(cfg, str(model), cpu="flags : sse2"),
    }
    model.write_bytes(b"other weights")
    changed.add(artifact_key(cfg, str(model)))
    assert key not in changed and len(changed) == 5


def test_a_second_process_reads_every_graph_from_the_cache(first_and_second, cache_home):
    """The first process generates the graphs and saves them under the kvserve cache; the second,
    with an empty Inductor cache, generates none and decodes the same tokens."""
    first, second = first_and_second
    assert first["compiled"] and second["compiled"]
    assert first["misses"] > 0
    assert second["misses"] == 0 and second["hits"] >= first["misses"] - first["hits"], second
    assert second["tokens"] == first["tokens"]
    assert list((cache_home / "kvserve" / "compiled").glob("*.bin"))


@pytest.fixture
def gated(monkeypatch, cache_home, first_and_second):
    """Background compiles that wait for `gate` before compiling (the cache is warm: they then read
    the graphs from it)."""
    monkeypatch.setenv(EAGER_ENV, "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    monkeypatch.setattr(startup, "_sources_digest", lambda: "sources")   # the workers' key
    gate = threading.Event()
    real = startup.StartupCompile._compile

    def held(self, show_progress):
        gate.wait(600)
        return real(self, show_progress)
    monkeypatch.setattr(startup.StartupCompile, "_compile", held)
    return gate


def test_switching_to_compiled_between_steps_decodes_like_blocking(tiny, gated, monkeypatch):
    """A background engine runs its first steps eagerly, installs the compiled graphs at a step
    boundary in the middle of a request, and its greedy tokens are the blocking engine's (and the
    eager engine's: float32 activations)."""
    llm = LLM(tiny, **TINY)
    engine = llm.engine
    assert engine.startup.mode == "background" and not engine.compiled
    assert engine.model.model.regions is EAGER
    assert not startup.compiling()   # the thread waits for the first step: its first token comes first
    rid = engine.add_request(PROMPT, GREEDY)
    engine.step()
    assert startup.compiling()
    for _ in range(3):
        engine.step()
    assert not engine.compiled and engine.model.model.regions is EAGER
    gated.set()
    assert llm.wait_compiled(600)
    assert engine.compiled and engine.model.model.regions is not EAGER
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                out = o
    got = out.outputs[0].token_ids
    blocking = LLM(tiny, compile_mode="blocking", **TINY)
    assert blocking.engine.compiled
    want = blocking.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    eager = LLM(tiny, enforce_eager=True, **TINY)
    # every greedy pick is the eager model's argmax over the same tokens, up to the rounding by
    # which compiled int8 steps differ from eager ones (random weights have near-ties)
    for tokens in (got, want):
        logits = _recomputed_logits(eager, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
        picked = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (picked >= logits.max(dim=1).values - ARGMAX_TOL).all(), (tokens, logits.argmax(dim=1).tolist())


def test_an_engine_without_steps_starts_compiling_when_idle(tiny, gated, monkeypatch):
    """No step within IDLE_START seconds (a server waiting for its first request): the background
    compile starts anyway."""
    monkeypatch.setattr(startup, "IDLE_START", 0.2)
    llm = LLM(tiny, **TINY)
    deadline = time.monotonic() + 30
    while not startup.compiling() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert startup.compiling() and not llm.engine.compiled
    gated.set()
    assert llm.wait_compiled(600)


ARGMAX_TOL = 0.05


def _recomputed_logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of a no-cache forward of `ids` by `llm`'s model."""
    from kvserve.attention import AttentionMetadata, PrefillSpan
    model = llm.engine.model
    with torch.inference_mode():
        meta = AttentionMetadata(prefills=[PrefillSpan(0, len(ids), len(ids))])
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta)).float()


def test_a_failed_background_compile_leaves_the_engine_eager(tiny, monkeypatch, caplog):
    """A compile that fails on its thread (say, no C++ compiler) logs why; the engine keeps serving
    eagerly and decodes like an eager engine."""
    monkeypatch.setenv(EAGER_ENV, "0")

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(startup, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        llm = LLM(tiny, **TINY)
        assert llm.wait_compiled(600) is False
    assert llm.engine.startup.state == "failed" and llm.engine.model.model.regions is EAGER
    assert "compiling failed" in caplog.text and "no compiler" in caplog.text
    got = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    want = LLM(tiny, enforce_eager=True, **TINY).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_health_answers_503_while_the_model_loads(tmp_path):
    """`kvserve serve` listens before its model is loaded: /health answers llama-server's 503
    "Loading model" until then, 200 after, and the log names each start-up phase with its time."""
    from test_server import _free_port
    port = _free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--uvicorn-log-level", "warning",
           "--kv-cache-memory", "64MiB", "--max-model-len", "512"]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if not seen or seen[-1][0] != r.status_code:
                seen.append((r.status_code, r.json()))
            if r.status_code == 200:
                break
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(60)
    assert [s for s, _ in seen] == [503, 200], (seen, log_path.read_text()[-3000:])
    assert seen[0][1]["error"]["code"] == 503 and seen[0][1]["error"]["message"] == "Loading model"
    text = log_path.read_text()
    for name in ("import", "model resolve", "KV pool", "server ready"):
        assert f"start-up: {name} " in text, name
