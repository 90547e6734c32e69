"""Tensor parallel over N processes: rank 0 is the engine (it schedules, samples and answers); ranks
1..N-1 are worker processes that hold their shard of the model and their own KV pool and run the
same step as rank 0, from the step message rank 0 broadcasts before each forward. Over several hosts
(nnodes > 1) node 0 holds rank 0 and its local ranks and each other node runs `kvserve tp-node`
(launch.py), which starts that node's ranks from the config rank 0 publishes in its store.

Every rank's pool holds only its KV heads and is sized from its own budget (kv_cache_memory is per
rank); all ranks take the smallest block count of them, since rank 0's KV manager hands out block
ids for all. A rank that dies fails the engine with a RuntimeError naming it: rank 0 checks its local
workers before each step, and a collective whose peer is gone fails (at once when its socket closes,
else after tensor_parallel_timeout seconds); a remote rank is then named from its node's report, or
by its node's heartbeat stopping.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBackends, AttentionMetadata, PrefillSpan, StepBatch
from kvserve.distributed.group import Group, follower_store, leader_store, node_address
from kvserve.distributed.launch import (
    Layout,
    RemoteNodes,
    describe_exit,
    joined_key,
    never_joined,
    spawn_rank,
    stop_procs,
)
from kvserve.distributed.sharding import (
    check_model,
    parallelize,
    plan_shard,
    shard_config,
    shard_weights,
)
from kvserve.engine.builder import CachePlanner, LoadedModel, load_tokenizer
from kvserve.engine.eviction import extend_positions
from kvserve.engine.memory import check_fits
from kvserve.engine.model_runner import ModelInput, ModelRunner
from kvserve.engine.options import engine_options
from kvserve.model.layers import fuse_projections
from kvserve.model.loader import load_weights, resolve_model_path
from kvserve.model.registry import build_model

log = logging.getLogger("kvserve")

SUPPORTED = ("tensor parallel supports Llama-family models (llama, qwen2, qwen3, mistral) with unquantized "
             "weights (weights equal to dtype, e.g. weights='float32', dtype='float32') and a plain KV cache "
             "(kv_cache_dtype auto, float32, bfloat16 or float16)")


def check_config(config) -> None:
    """Raise ValueError for options tensor parallel does not run, saying what it does run."""
    from kvserve.config import DTYPES
    from kvserve.kv.formats import is_quantized

    refused = []
    if config.weights != "auto" and config.weights not in DTYPES:
        refused.append(f"weights={config.weights!r}")
    if config.weights != "auto" and config.dtype != "auto" and config.weights != config.dtype:
        refused.append(f"weights={config.weights!r} with dtype={config.dtype!r}")
    kv = [config.kv_cache_dtype, config.kv_cache_dtype_k, config.kv_cache_dtype_v]
    refused += [f"kv_cache_dtype={n!r}" for n in kv if n is not None and is_quantized(n)]
    for name in ("kv_policy", "kv_tiers", "swap_space", "kv_cache_head_precision", "kv_cache_dtype_skip_layers"):
        if getattr(config, name):
            refused.append(f"{name}={getattr(config, name)!r}")
    if refused:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} cannot run "
                         f"{', '.join(refused)}: {SUPPORTED}")
    if config.node_rank != 0:
        raise ValueError(f"node_rank={config.node_rank}: the engine runs on node 0 (node_rank=0); on node "
                         f"{config.node_rank} run `{Layout.of(config).command(config.node_rank)}`")


def check_weight_format(config, dtype: torch.dtype) -> str:
    """The linear weight format, which must be `dtype` itself (no quantized weights)."""
    from kvserve.config import DTYPES
    fmt, why = config.weight_format()
    if DTYPES.get(fmt) != dtype:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} cannot run {fmt} weights with "
                         f"{str(dtype).removeprefix('torch.')} activations ({why}): {SUPPORTED}")
    return fmt


def rank_device(config, rank: int) -> torch.device:
    """CUDA rank r runs on cuda:(its place on its node); CPU ranks on the CPU."""
    device = config.torch_device()
    return torch.device("cuda", rank % Layout.of(config).per_node) if device.type == "cuda" else device


def load_shard(config, group: Group, device: torch.device, dtype: torch.dtype, weights=None) -> LoadedModel:
    """This rank's slice of the model on `device`, its o_proj and down_proj summed over `group`."""
    from kvserve.engine.builder import _max_model_len
    t0 = time.perf_counter()
    path = resolve_model_path(config.model)
    mc, weights = weights or load_weights(path, dtype)
    shard = plan_shard(mc, group.rank, group.size)
    model = build_model(shard_config(mc, shard))
    missing, unexpected = model.load_state_dict(shard_weights(weights, mc, shard), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and mc.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    del weights
    model = model.to(device=device, dtype=dtype).eval()
    fuse_projections(model)
    parallelize(model, group)
    max_model_len = _max_model_len(config, mc)
    extend_positions(model, max_model_len)
    fmt = check_weight_format(config, dtype)
    return LoadedModel(path, mc, load_tokenizer(path) if group.rank == 0 else None, model, fmt, dtype,
                       max_model_len, time.perf_counter() - t0, False)


class ShardPlanner(CachePlanner):
    """CachePlanner of one rank: its pool from its own budget, then the smallest block count of all ranks."""

    def __init__(self, config, loaded: LoadedModel, device: torch.device, group: Group, fail=None):
        self.group = group
        self.fail = fail  # rank 0: TensorParallel.fail, which names a rank that died
        super().__init__(config, loaded, device)

    def plan_pool(self):
        plan = super().plan_pool()
        try:
            fewest = self.group.min(plan.num_blocks)
        except RuntimeError as exc:
            if self.fail is None:
                raise
            raise self.fail(f"sizing the KV pools failed ({str(exc).splitlines()[0][:300]})") from exc
        if fewest < plan.num_blocks:
            plan.num_blocks = fewest
            check_fits(plan, self.blocks_per_sequence(plan.block_size), self.max_model_len, self.bound_note())
        return plan


@dataclass
class StepMessage:
    """What ranks > 0 need to run rank 0's step: the flat batch, the step batch and block tables each
    group's backend prepares its metadata from, and the copy-on-write block copies to run first."""

    input_ids: torch.Tensor            # [num_tokens]
    positions: torch.Tensor            # [num_tokens]
    num_decodes: int
    prefills: list[PrefillSpan]
    step: StepBatch | None
    tables: list[torch.Tensor] | None  # per group: [R, W]
    copies: list[tuple[int, int]]


def step_message(inp: ModelInput, copies: list[tuple[int, int]]) -> StepMessage:
    """The step as CPU tensors (the control channel pickles it)."""
    cpu = torch.device("cpu")
    step = inp.step
    if step is not None and step.token_req.device != cpu:
        step = StepBatch(step.num_decodes, step.counts, step.token_req.cpu(), step.token_off.cpu(),
                         step.cache_lens, [t.cpu() for t in step.cache_len_t])
    tables = [t.cpu() for t in inp.tables] if inp.tables is not None else None
    return StepMessage(inp.input_ids.cpu(), inp.positions.cpu(), inp.meta.num_decodes, inp.meta.prefills,
                       step, tables, copies)


class LeaderRunner(ModelRunner):
    """Rank 0's runner: broadcasts each step to the other ranks, then runs its own shard."""

    def __init__(self, tp: TensorParallel, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp = tp

    def forward(self, inp: ModelInput) -> torch.Tensor:
        copies = self.kv.take_pending_copies()
        self.tp.check()
        try:
            self.tp.group.broadcast_object(step_message(inp, copies))
            if copies:
                self.storage.copy_blocks(copies)
            return self.model(inp.input_ids, inp.positions, inp.meta)
        except RuntimeError as exc:
            raise self.tp.fail(f"a collective failed ({str(exc).splitlines()[0][:300]})") from exc


class Follower:
    """A rank > 0: its shard, its KV pool and one backend per KV group; runs rank 0's steps."""

    def __init__(self, config, group: Group):
        self.group = group
        self.device = rank_device(config, group.rank)
        dtype = config.torch_dtype()
        self.loaded = load_shard(config, group, self.device, dtype)
        self.model = self.loaded.model
        planner = ShardPlanner(config, self.loaded, self.device, group)
        self.kv, self.storage = planner.build()
        # rank 0's runner decides the same way: without a cache a step's metadata has no backends
        self._metadata = self._cached_metadata if self.kv.holds_kv else self._plain_metadata
        if self.kv.holds_kv:
            self.attn = AttentionBackends.select(self.storage, self.kv.groups, config.attention())

    def serve(self) -> None:
        """Run steps until rank 0 sends None."""
        while True:
            msg = self.group.broadcast_object()
            if msg is None:
                return
            self.run(msg)

    @torch.inference_mode()
    def run(self, msg: StepMessage) -> None:
        """One step of this rank's shard (its hidden states are rank 0's; only rank 0 computes logits)."""
        dev = self.device
        self.storage.copy_blocks(msg.copies)
        self.model(msg.input_ids.to(dev), msg.positions.to(dev), self._metadata(msg))

    def _plain_metadata(self, msg: StepMessage) -> AttentionMetadata:
        """No cache: the step's prefill spans, no backends."""
        return AttentionMetadata(num_decodes=msg.num_decodes, prefills=msg.prefills)

    def _cached_metadata(self, msg: StepMessage) -> AttentionMetadata:
        """Each group's backend prepares its metadata from rank 0's step batch and block tables."""
        dev, step = self.device, msg.step
        if dev.type != "cpu":
            step = StepBatch(step.num_decodes, step.counts, step.token_req.to(dev), step.token_off.to(dev),
                             step.cache_lens, [t.to(dev) for t in step.cache_len_t])
        return self.attn.metadata(step, [t.to(dev) for t in msg.tables], msg.prefills)


def start_ranks(config) -> TensorParallel:
    """Rank 0's handle on ranks 1..size-1 for `config`, its options checked first."""
    config = engine_options(config)
    return TensorParallel(config, config.torch_device(), config.torch_dtype())


class TensorParallel:
    """Rank 0's side: starts its node's ranks 1..per_node-1 as worker processes (the other nodes' ranks
    come from their `kvserve tp-node`), holds the group, watches the workers."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype):
        check_config(config)              # the options it runs, before anything loads
        self.config, self.size = config, config.tensor_parallel_size
        self.layout = Layout.of(config)
        self.failed: str | None = None
        mc, weights = load_weights(resolve_model_path(config.model), dtype)
        check_model(mc, self.size)        # before any process starts
        check_weight_format(config, dtype)
        self.store = leader_store(self.size, config.tensor_parallel_timeout, config.master_addr, config.master_port)
        self.remote = RemoteNodes(self.store, self.layout, config)
        self.errors = tempfile.mkdtemp(prefix="kvserve-tp-")
        self.procs = [self._spawn(rank, self.store.port) for rank in self.layout.ranks(0)[1:]]
        self._finalizer = weakref.finalize(self, _cleanup, self.procs, self.errors)
        try:
            self.group = self._join(device)
            self.loaded = load_shard(config, self.group, device, dtype, (mc, weights))
        except BaseException as exc:
            raise self.fail(f"start-up failed ({exc})") from exc
        log.info("tensor parallel: %d ranks on %d node(s) (%s), this rank holds KV heads %s of %d", self.size,
                 self.layout.nnodes, type(self.group.compute).__name__, plan_shard(mc, 0, self.size).kv_heads,
                 mc.num_kv_heads)

    def _spawn(self, rank: int, port: int) -> subprocess.Popen:
        return spawn_rank(rank, self.size, port, self._error_file(rank), self.config)

    def _error_file(self, rank: int) -> str:
        return os.path.join(self.errors, f"rank{rank}.txt")

    def _join(self, device: torch.device) -> Group:
        """Rank 0's group, made while watching the workers: one that exits before joining fails start-up
        at once; ranks that have not joined within tensor_parallel_timeout fail it, named."""
        done: dict = {}
        timeout = self.config.tensor_parallel_timeout
        host = node_address(self.layout.master_addr, self.layout.nnodes)

        def connect():
            try:
                done["group"] = Group(self.store, 0, self.size, device, timeout, host)
            except BaseException as exc:
                done["error"] = exc
        thread = threading.Thread(target=connect, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            thread.join(0.05)
            if not thread.is_alive():
                break
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a worker rank exited before joining the group")
            if self.remote.exited():
                raise RuntimeError("a rank on another node exited before joining the group")
            if time.monotonic() > deadline:
                raise RuntimeError(self._not_joined(timeout))
        if "error" in done:
            if never_joined(self.store, range(1, self.size)):
                raise RuntimeError(self._not_joined(timeout)) from done["error"]
            raise done["error"]
        return done["group"]

    def _not_joined(self, timeout: float) -> str:
        """Which ranks never joined, and what to run where."""
        missing = never_joined(self.store, range(1, self.size))
        if not missing:
            return (f"every rank joined rank 0's store but the group did not form within {timeout:g} s: gloo "
                    "connects each pair of ranks directly, on ports it picks on each node's address, so the "
                    "nodes must reach each other on every TCP port")
        text = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} never joined within {timeout:g} s"
        nodes = sorted({self.layout.node_of(r) for r in missing} - {0})
        if nodes:
            text += ": start " + "; ".join(f"`{self.layout.command(n)}` on node {n}" for n in nodes)
        return text

    def planner(self, config, loaded: LoadedModel, device: torch.device) -> ShardPlanner:
        """Rank 0's cache planner."""
        return ShardPlanner(config, loaded, device, self.group, self.fail)

    def runner(self, *args, **kwargs) -> LeaderRunner:
        """Rank 0's model runner (ModelRunner's arguments)."""
        return LeaderRunner(self, *args, **kwargs)

    def check(self) -> None:
        """Raise RuntimeError if the engine failed or a worker rank has exited."""
        if self.failed is not None:
            raise RuntimeError(self.failed)
        if any(p.poll() is not None for p in self.procs):
            raise self.fail("a worker rank exited")
        # a remote rank is not polled here (a store round trip each step): the step's first collective
        # fails when its sockets close, and fail() names it from its node's report or heartbeat

    def fail(self, what: str) -> RuntimeError:
        """Stop the workers (the other nodes' too) and return the error that ends this engine (every later
        step raises it too). A remote rank is named from its node's report, or its node's silent heartbeat."""
        dead = [describe_exit(rank, p, self._error_file(rank)) for rank, p in enumerate(self.procs, 1)
                if p.poll() is not None]
        dead += self.remote.lost()
        stop_procs(self.procs, 0.0)
        self.remote.stop(what)
        self.failed = (f"tensor parallel engine failed: {what}; " + ("; ".join(dead) if dead else
                       "no worker had exited") + f". All {self.size} ranks are stopped: create a new LLM")
        return RuntimeError(self.failed)

    def close(self) -> None:
        """Tell the workers to exit and wait for them (and for the other nodes to see theirs exit)."""
        clean = self.failed is None
        if clean:
            try:
                self.group.broadcast_object(None)
            except RuntimeError:
                pass
            self.failed = "tensor parallel workers were stopped (LLM.close()): create a new LLM"
            self.remote.stop("")
        stop_procs(self.procs)
        if clean:
            self.remote.wait_done(5.0)
        self._finalizer()


def _cleanup(procs: list[subprocess.Popen], errors: str) -> None:
    """Kill workers still running and remove their error files."""
    stop_procs(procs, 0.0)
    shutil.rmtree(errors, ignore_errors=True)


def worker_main(rank: int, size: int, port: int, error_file: str) -> int:
    """A worker rank: join the group, load the shard, run steps until told to stop."""
    config = pickle.loads(sys.stdin.buffer.read())
    try:
        host = node_address(config.master_addr, config.nnodes)
        store = follower_store(config.master_addr, port, config.tensor_parallel_timeout)
        store.set(joined_key(rank), host)
        group = Group(store, rank, size, rank_device(config, rank), config.tensor_parallel_timeout, host)
        Follower(config, group).serve()
        return 0
    except BaseException:
        with open(error_file, "w") as f:
            f.write(traceback.format_exc())
        return 1

