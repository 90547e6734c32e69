"""Tensor parallel over real processes (gloo on loopback, 2 ranks) against one process, on tiny
random checkpoints: same greedy tokens and log-probs, per-rank KV pools, a dead rank fails loudly."""

import os
import signal
import time

import pytest
import torch
from family_checkpoints import make_tiny_checkpoint
from helpers import all_blocks_free, assert_same_completions

from kvserve import LLM, SamplingParams
from kvserve.distributed.sharding import plan_shard, valid_sizes
from kvserve.kv.sizing import kv_heads_per_gpu
from kvserve.model.config import ModelConfig

OPTIONS = dict(dtype="float32", weights="float32", kv_cache_memory="4MiB", max_model_len=256, block_size=4,
               max_num_batched_tokens=16, tensor_parallel_timeout=30)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {f: make_tiny_checkpoint(f, root) for f in ("llama", "qwen2_mqa")}


def _prompts():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 256, (24,), generator=g).tolist()
    tail = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 30)]
    return [shared + tail[0], tail[1], shared + tail[2], [7]]  # a prefix hit, chunked prefills, one token


def _generate(llm):
    """Greedy completions with log-probs and prompt log-probs; n=2 forks share blocks copy-on-write."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    first = llm.generate(_prompts()[:1], params, use_tqdm=False)
    rest = llm.generate(_prompts(), params, use_tqdm=False)
    forks = llm.generate(_prompts()[1:2], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True,
                                                         logprobs=1), use_tqdm=False)
    scored = llm.generate(_prompts()[2:3], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return first + rest + forks + scored


@pytest.mark.parametrize("family, kv_share", [("llama", 0.5), ("qwen2_mqa", 1.0)])
def test_two_ranks_equal_one(checkpoints, family, kv_share):
    """GQA (4 query heads, 2 KV heads: one per rank) and MQA (1 KV head, replicated on both ranks)."""
    path = checkpoints[family]
    one = LLM(path, **OPTIONS)
    expected = _generate(one)
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as two:
        got = _generate(two)
        assert got[3].num_cached_tokens > 0  # the shared prefix was reused on both ranks
        assert_same_completions(got, expected)
        for pa, pb in zip(got[-1].prompt_logprobs[1:], expected[-1].prompt_logprobs[1:]):
            assert {t: p.logprob for t, p in pa.items()} == pytest.approx(
                {t: p.logprob for t, p in pb.items()}, abs=1e-4)
        assert all_blocks_free(two)
        # each rank's pool holds only its KV heads, from its own 4 MiB
        assert two.kv_bytes_per_token == one.kv_bytes_per_token * kv_share
        assert two.get_metrics()["num_blocks_total"] == pytest.approx(
            one.get_metrics()["num_blocks_total"] / kv_share, rel=0.01)
        workers = two.engine.tp.procs
    assert all(p.poll() == 0 for p in workers)  # close() stopped them cleanly


def test_killed_rank_fails_loudly(checkpoints):
    """A worker killed between steps: the next step raises at once, naming the rank."""
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)
    proc = llm.engine.tp.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with status -9"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="tensor parallel engine failed"):  # and stays failed
        llm.generate([[8]], params, use_tqdm=False)
    assert time.monotonic() - t0 < 5
    assert all_blocks_free(llm)


def test_killed_rank_mid_collective_fails_loudly(checkpoints):
    """The liveness check skipped: rank 0's collective sees the closed socket and fails, no hang."""
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **OPTIONS)
    tp = llm.engine.tp
    proc = tp.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    tp.check = lambda: None
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a collective failed .*rank 1 \(pid \d+\) exited"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - t0 < OPTIONS["tensor_parallel_timeout"]


def test_rank_that_exits_at_start_up_fails_it_at_once(checkpoints, monkeypatch):
    import subprocess
    import sys

    from kvserve.distributed.tensor_parallel import TensorParallel
    monkeypatch.setattr(TensorParallel, "_spawn", lambda self, rank, port: subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.exit(3)"]))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"start-up failed .* rank 1 \(pid \d+\) exited with status 3"):
        LLM(checkpoints["llama"], tensor_parallel_size=2, **OPTIONS)
    assert time.monotonic() - t0 < 10


def test_sizes_that_do_not_split_the_model_are_refused(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split .* sizes that work: 1, 2, 4"):
        LLM(checkpoints["llama"], tensor_parallel_size=3, **OPTIONS)


@pytest.mark.parametrize("option, value", [("weights", "int8"), ("kv_policy", "window:32"),
                                           ("kv_cache_dtype", "int8"), ("swap_space", 1.0)])
def test_unsupported_options_are_refused(checkpoints, option, value):
    with pytest.raises(ValueError, match=f"cannot run {option}=.*tensor parallel supports Llama-family"):
        LLM(checkpoints["llama"], tensor_parallel_size=2, **{**OPTIONS, option: value})


def test_other_families_are_refused(tmp_path):
    path = make_tiny_checkpoint("gemma3", tmp_path)
    with pytest.raises(ValueError, match="tensor parallel supports the Llama family .* is 'gemma3'"):
        LLM(path, tensor_parallel_size=2, **OPTIONS)


def _config(heads, kv_heads, intermediate=128):
    return ModelConfig("llama", 256, 64, intermediate, 2, heads, kv_heads, 16, 1e-6, 1e4, None, 512, False,
                       None, [2], "tiny")


@pytest.mark.parametrize("heads, kv_heads, size", [(8, 8, 4), (8, 2, 4), (8, 1, 8), (4, 2, 2), (32, 8, 8)])
def test_shards_cover_every_head_once_and_match_the_planner(heads, kv_heads, size):
    mc = _config(heads, kv_heads)
    shards = [plan_shard(mc, r, size) for r in range(size)]
    assert [s.q_heads for s in shards] == [(r * heads // size, (r + 1) * heads // size) for r in range(size)]
    for s in shards:  # each query head's KV head is on its rank
        group = heads // kv_heads
        assert all(s.kv_heads[0] <= q // group < s.kv_heads[1] for q in range(*s.q_heads))
        assert s.kv_heads[1] - s.kv_heads[0] == kv_heads_per_gpu(kv_heads, size)  # `kvserve plan`'s figure
    assert {h for s in shards for h in range(*s.kv_heads)} == set(range(kv_heads))
    assert size in valid_sizes(heads, kv_heads, 128)


def test_cli_has_the_flag():
    import argparse

    from kvserve.engine_args import add_engine_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2 and args.tensor_parallel_timeout == 300.0


def test_an_engine_built_without_its_ranks_says_how(checkpoints):
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import LLMEngine
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs the ranks started .* through LLM\(\.\.\.\)"):
        LLMEngine(EngineConfig(model=checkpoints["llama"], tensor_parallel_size=2, **OPTIONS))
