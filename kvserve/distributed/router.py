"""Prefix-aware routing over engine replicas, fed by the KV events each replica publishes.

`PrefixIndex` keeps, per replica and KV group, the chained block hashes its prefix cache holds,
from the event batches of kv/events.py (BlockStored adds, BlockRemoved drops, AllBlocksCleared
empties). Batches carry sequence numbers: a gap is filled from the replica's replay socket
(`ReplayClient`), what the replay no longer holds is counted as lost, and a stream that starts
again at 0 (a restarted replica) starts the replica's blocks afresh. `PromptHasher` hashes a
prompt exactly as the engine's KV manager does (kv/hashing.py under the engine's namespace), so
the router and the engine name the same blocks. `Router.pick` chooses a replica by policy:
round-robin, least-loaded (queue depth, then KV usage) or prefix (prefix tokens held, weighed
against load; no hit anywhere falls back to least loaded). The prefix policy also counts the blocks
of prompts it sent to a replica in the last PENDING_S seconds as held there: a replica publishes a
prompt's blocks only once its prefill is done, and requests sharing that prompt which arrive
meanwhile would otherwise be spread over the replicas.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.extras import require
from kvserve.kv.events import END_SEQ, decode_batch
from kvserve.kv.hashing import DEFAULT_HASH_ALGO, BlockHash, hash_full_blocks

log = logging.getLogger("kvserve")

POLICIES = ("round-robin", "least-loaded", "prefix")
DEFAULT_QUEUE_COST = 128   # prefix tokens one queued request on a replica is worth
DEFAULT_KV_COST = 256      # prefix tokens a full KV cache (usage 1.0) is worth
PENDING_S = 30.0           # seconds a routed prompt's blocks count as on its replica before events say so
PENDING_MAX = 1 << 16      # block hashes remembered per replica that way (oldest forgotten first)
SHARED_MEDIA = ("redis",)  # a tier every replica reads: its blocks do not tell replicas apart

Replay = Callable[[str, int], list[tuple[int, bytes]]]  # (replica, first seq) -> [(seq, payload)]


# ---- prompt hashes ------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptHasher:
    """A prompt's block hashes as one engine's KV manager computes them (same namespace and algorithm)."""

    namespace: BlockHash
    block_size: int
    algo: str = DEFAULT_HASH_ALGO

    @classmethod
    def from_kv(cls, kv) -> PromptHasher:
        """The hasher of a KVCacheManager (`llm.engine.kv`)."""
        return cls(kv.namespace, kv.block_size, kv.hash_algo)

    def block_hashes(self, token_ids: list[int], salt: str | None = None) -> list[BlockHash]:
        """Hashes of the blocks a prefix hit can use: full blocks before the last token."""
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        return hash_full_blocks(self.namespace, list(token_ids[:max(usable, 0)]), self.block_size,
                                algo=self.algo, salt=salt)


def hit_groups(kv) -> tuple[int, ...]:
    """The KV groups of a KVCacheManager whose every block a prefix hit needs (not sliding-window ones)."""
    return tuple(g for g, group in enumerate(kv.groups) if not group.spec.keeps_window) or (0,)


# ---- the index ----------------------------------------------------------------------------


@dataclass
class ReplicaBlocks:
    """What one replica's prefix cache holds, and where its event stream is."""

    groups: dict[int, set[BlockHash]] = field(default_factory=dict)   # on the device, per KV group
    tiers: dict[tuple[int, str], set[BlockHash]] = field(default_factory=dict)  # (group, medium): cpu, disk
    next_seq: int = 0          # the sequence number of the next batch expected
    lost_batches: int = 0      # batches neither received nor replayed

    def held(self, group: int) -> set[BlockHash]:
        """Blocks of `group` on the device."""
        return self.groups.setdefault(group, set())

    def where(self, group: int, medium: str) -> set[BlockHash] | None:
        """The set an event of `medium` updates: None for a tier shared by every replica (redis)."""
        if medium in (None, "device", "gpu"):
            return self.held(group)
        if medium in SHARED_MEDIA:
            return None
        return self.tiers.setdefault((group, medium), set())

    def local(self, group: int) -> list[set[BlockHash]]:
        """Every set of this replica's own blocks of `group` (device first, then its cpu/disk tiers)."""
        return [self.held(group)] + [s for (g, _), s in self.tiers.items() if g == group]


class PrefixIndex:
    """Which replica holds which chained block hashes, per KV group, from KV event batches.

    Not locked: feed it and route from one thread (or one event loop). Filling a gap waits for the
    replay's answer (ReplayClient: up to its timeout)."""

    def __init__(self, replay: Replay | None = None):
        self.replay = replay
        self.replicas: dict[str, ReplicaBlocks] = {}

    def feed(self, name: str, seq: int, payload: bytes) -> None:
        """One batch as published (msgpack payload); fills a gap before it from the replay."""
        state = self.replicas.setdefault(name, ReplicaBlocks())
        if seq == 0 and state.next_seq > 0:  # the replica restarted: its cache is new
            log.info("KV events of replica %s start again at 0: its blocks are forgotten", name)
            state = self.replicas[name] = ReplicaBlocks()
        if seq < state.next_seq:
            return  # already applied (a replayed batch arriving again)
        if seq > state.next_seq:
            self._fill_gap(name, state, seq)
        self._apply(state, decode_batch(payload)[1])
        state.next_seq = seq + 1

    def apply_events(self, name: str, events: Iterable[list]) -> None:
        """Events (decoded wire arrays) with no sequence number: applied as they are."""
        self._apply(self.replicas.setdefault(name, ReplicaBlocks()), events)

    def drop_replica(self, name: str) -> None:
        """Forget a replica (dead or removed) and every block it held."""
        self.replicas.pop(name, None)

    def holds(self, name: str, group: int = 0) -> set[BlockHash]:
        """The hashes replica `name` holds in `group` (empty for an unknown replica)."""
        state = self.replicas.get(name)
        return set(state.held(group)) if state else set()

    def prefix_blocks(self, name: str, hashes: list[BlockHash], groups: Iterable[int] = (0,)) -> int:
        """Leading blocks of `hashes` the replica holds in every one of `groups`."""
        state = self.replicas.get(name)
        if state is None:
            return 0
        held = [state.local(g) for g in groups]
        n = 0
        while n < len(hashes) and all(any(hashes[n] in s for s in sets) for sets in held):
            n += 1
        return n

    def _fill_gap(self, name: str, state: ReplicaBlocks, seq: int) -> None:
        replayed = self.replay(name, state.next_seq) if self.replay else []
        for r_seq, payload in replayed:
            if state.next_seq <= r_seq < seq:
                if r_seq > state.next_seq:
                    state.lost_batches += r_seq - state.next_seq
                self._apply(state, decode_batch(payload)[1])
                state.next_seq = r_seq + 1
        if state.next_seq < seq:
            state.lost_batches += seq - state.next_seq
            log.warning("KV events of replica %s: batches %d-%d lost (not in its replay buffer); its "
                        "index may name blocks it no longer holds", name, state.next_seq, seq - 1)

    @staticmethod
    def _apply(state: ReplicaBlocks, events: Iterable[list]) -> None:
        for event in events:
            kind = event[0]
            if kind == "BlockStored":
                blocks = state.where(_group(event, 7), _field(event, 6))
                if blocks is not None:
                    blocks.update(event[1])
            elif kind == "BlockRemoved":
                blocks = state.where(_group(event, 3), _field(event, 2))
                if blocks is not None:
                    blocks.difference_update(event[1])
            elif kind == "AllBlocksCleared":
                state.groups.clear()   # the device cache only: the tiers keep their entries
            else:
                log.warning("KV events: unknown event type %r ignored", kind)


def _field(event: list, index: int):
    return event[index] if len(event) > index else None


def _group(event: list, index: int) -> int:
    """The KV group of an event (vLLM's events have no group field: group 0)."""
    return event[index] if len(event) > index and event[index] is not None else 0


# ---- reading a replica's event stream -----------------------------------------------------


class ReplayClient:
    """Asks a replica's replay socket (a ROUTER) for the batches from a sequence number on."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0, ctx=None):
        self.zmq = require("zmq", "events", "KV events")
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self.ctx = ctx or self.zmq.Context.instance()

    def fetch(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch with sequence number >= `start`, as (seq, payload); [] on a timeout."""
        sock = self.ctx.socket(self.zmq.DEALER)
        sock.setsockopt(self.zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while sock.poll(self.timeout_ms):
                _, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
            log.warning("KV events: no end of replay from %s within %d ms", self.endpoint, self.timeout_ms)
            return out
        finally:
            sock.close()


class EventFeed:
    """Subscribes to one replica's PUB socket and feeds its batches into a PrefixIndex."""

    def __init__(self, index: PrefixIndex, name: str, endpoint: str, ctx=None):
        self.zmq = require("zmq", "events", "KV events")
        self.index, self.name = index, name
        self.sock = (ctx or self.zmq.Context.instance()).socket(self.zmq.SUB)
        self.sock.setsockopt(self.zmq.LINGER, 0)
        self.sock.setsockopt(self.zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Feed every batch that arrives within `timeout_s` (then what is queued); how many."""
        n = 0
        wait = int(timeout_s * 1000)
        while self.sock.poll(wait):
            _, seq, payload = self.sock.recv_multipart()
            self.index.feed(self.name, int.from_bytes(seq, "big"), payload)
            n, wait = n + 1, 0
        return n

    def close(self) -> None:
        self.sock.close()


# ---- the router ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaLoad:
    """How busy a replica is: requests queued or running, and the share of its KV blocks in use."""

    queue_depth: int = 0
    kv_usage: float = 0.0


class Router:
    """Picks a replica for each request: round-robin, least-loaded or prefix-aware."""

    def __init__(self, policy: str = "prefix", index: PrefixIndex | None = None,
                 hasher: PromptHasher | None = None, groups: Iterable[int] = (0,),
                 queue_cost: float = DEFAULT_QUEUE_COST, kv_cost: float = DEFAULT_KV_COST,
                 clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        if policy == "prefix" and hasher is None:
            raise ValueError("the prefix policy needs the engines' PromptHasher (namespace, block size, algorithm)")
        self.policy = policy
        self.index = index if index is not None else PrefixIndex()
        self.hasher = hasher
        self.groups = tuple(groups)    # the KV groups a hit needs (sliding-window groups need not be)
        self.queue_cost, self.kv_cost = queue_cost, kv_cost
        self.turn = 0                  # round-robin position
        self.clock = clock
        self.pending: dict[str, OrderedDict[BlockHash, float]] = {}  # replica -> routed block -> when

    def pick(self, prompt_token_ids: list[int], loads: dict[str, ReplicaLoad], salt: str | None = None) -> str:
        """The replica to send this prompt to, among those in `loads`."""
        names = self._rotation(loads)
        if self.policy == "round-robin":
            return names[0]
        if self.policy == "least-loaded":
            return self.least_loaded(names, loads)
        return self.by_prefix(names, loads, prompt_token_ids, salt)

    def least_loaded(self, names: list[str], loads: dict[str, ReplicaLoad]) -> str:
        """Fewest queued requests, then lowest KV usage; ties go to the first in `names`."""
        return min(names, key=lambda n: (_load(loads, n).queue_depth, _load(loads, n).kv_usage))

    def by_prefix(self, names: list[str], loads: dict[str, ReplicaLoad], prompt_token_ids: list[int],
                  salt: str | None = None) -> str:
        """Highest score: prefix tokens held minus the load's cost; no hit: least loaded."""
        hashes = self.hasher.block_hashes(prompt_token_ids, salt)
        hit = self._hit_tokens(names, hashes)
        if not any(hit.values()):
            choice = self.least_loaded(names, loads)
        else:
            score = {n: hit[n] - self.load_cost(_load(loads, n)) for n in names}
            best = max(score.values())
            choice = self.least_loaded([n for n in names if score[n] == best], loads)
        self._remember(choice, hashes)
        return choice

    def hit_tokens(self, names: list[str], prompt_token_ids: list[int], salt: str | None = None) -> dict[str, int]:
        """Prompt tokens each replica holds as a cached prefix (or was sent within PENDING_S)."""
        return self._hit_tokens(names, self.hasher.block_hashes(prompt_token_ids, salt))

    def _hit_tokens(self, names: list[str], hashes: list[BlockHash]) -> dict[str, int]:
        now = self.clock()
        out = {}
        for n in names:
            held = self.index.prefix_blocks(n, hashes, self.groups)
            sent = self.pending.get(n, {})
            while held < len(hashes) and now - sent.get(hashes[held], -PENDING_S) < PENDING_S:
                held += 1
            out[n] = held * self.hasher.block_size
        return out

    def _remember(self, name: str, hashes: list[BlockHash]) -> None:
        """The blocks of a prompt just sent to `name`: held there until its events can say so."""
        sent = self.pending.setdefault(name, OrderedDict())
        now = self.clock()
        for h in hashes:
            sent[h] = now
            sent.move_to_end(h)
        while len(sent) > PENDING_MAX:
            sent.popitem(last=False)

    def load_cost(self, load: ReplicaLoad) -> float:
        """A replica's load in prefix tokens: queued requests and KV usage, each at its weight."""
        return self.queue_cost * load.queue_depth + self.kv_cost * load.kv_usage

    def drop_replica(self, name: str) -> None:
        """A replica died or left: forget its blocks (the caller stops listing it in `loads`)."""
        self.index.drop_replica(name)
        self.pending.pop(name, None)

    def _rotation(self, loads: dict[str, ReplicaLoad]) -> list[str]:
        """The replicas in name order, starting at the round-robin position (which then advances)."""
        names = sorted(loads)
        if not names:
            raise ValueError("no replica to route to: `loads` names none")
        start = self.turn % len(names)
        self.turn += 1
        return names[start:] + names[:start]


def _load(loads: dict[str, ReplicaLoad | None], name: str) -> ReplicaLoad:
    return loads.get(name) or ReplicaLoad()
