"""KVRouter: Ray Serve's request-router API driving kvserve's Router over engine replicas.

Ray Serve builds one KVRouter inside every handle to the engine deployment (here: the ingress).
Each engine replica reports, once, where its KV events are published and how it hashes blocks
(`record_replica_metadata`), and, every half second, its KV usage (`record_routing_stats`). The
router subscribes to every live replica's events (EventFeed into a PrefixIndex), asks
`Router.pick` for each request with the loads (Serve's count of the replica's ongoing requests,
and its KV usage), and forgets a replica's blocks once Serve drops it (dead or removed).

A request names its prompt token ids, cache salt and routing policy in its first argument
(`RouteInfo`); one with `replica` set goes to that replica only. Everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvserve.distributed.router import (
    EventFeed,
    PrefixIndex,
    PromptHasher,
    ReplayClient,
    ReplicaLoad,
    Router,
)

log = logging.getLogger("kvserve")

POLL_SECONDS = 0.02          # how often the feeds are read between requests
MAX_REMEMBERED = 10_000      # choices kept for requests not yet sent
ROUTERS: dict[str, KVRouter] = {}   # "app/deployment" -> this process's router (the ingress reads it)


@dataclass
class RouteInfo:
    """What the router needs to know about a request."""

    token_ids: list[int] | None = None   # the prompt (None: no prefix to match)
    salt: str | None = None              # its cache salt (the first block's hash depends on it)
    replica: str | None = None           # send to this replica only
    policy: str | None = None            # routing policy (None: the deployment's)


def meta_of(replica: RunningReplica) -> dict:
    """What the replica recorded about itself (record_replica_metadata; empty until it has)."""
    return getattr(replica, "replica_metadata", None) or {}


def replica_name(replica: RunningReplica) -> str:
    """The name a replica goes by in the index and the x-kvserve-replica header."""
    return replica.replica_id.unique_id


class KVRouter(RequestRouter):
    """Prefix-aware, least-loaded or round-robin routing over engine replicas, from their KV events."""

    def initialize_state(self, policy: str = "prefix", queue_cost: float | None = None,
                         kv_cost: float | None = None, **_):
        Router(policy, hasher=PromptHasher(b"", 16))  # refuses an unknown policy now
        self.policy = policy
        self.costs = {k: v for k, v in (("queue_cost", queue_cost), ("kv_cost", kv_cost)) if v is not None}
        self.index = PrefixIndex(replay=self._replay)
        self.routers: dict[str, Router] = {}    # policy -> Router (each keeps its own turn)
        self.chosen: OrderedDict[str, str] = OrderedDict()  # request -> replica, until it is sent
        self.hasher: PromptHasher | None = None  # the replicas' hashing, from the first one's metadata
        self.groups: tuple[int, ...] = (0,)
        self.feeds: dict[str, EventFeed] = {}
        self.replays: dict[str, ReplayClient] = {}
        self.poller: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        routers()[router_key(self.app_name, self._deployment_id.name)] = self

    # ---- Serve's hooks -----------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The one replica the policy picks. Router.pick runs once per request: when Serve retries
        (the replica was full, or slow to say how busy it is) the request waits for the same one,
        unless it is gone."""
        self.sync()
        by_name = {replica_name(r): r for r in candidate_replicas}
        info = route_info(pending_request)
        if info.replica is not None:
            return [[by_name[info.replica]]] if info.replica in by_name else [candidate_replicas]
        router = self.router(info.policy or self.policy)
        if router is None:
            return [candidate_replicas]
        rid = pending_request.metadata.internal_request_id if pending_request is not None else None
        chosen = self.chosen.get(rid)
        if chosen not in by_name:  # a retry keeps its choice while that replica lives
            loads = {name: self.load(r) for name, r in by_name.items()}
            chosen = router.pick(info.token_ids or [], loads, info.salt)
            self._remember(rid, chosen)
        return [[by_name[chosen]]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self.chosen.pop(pending_request.metadata.internal_request_id, None)

    def _remember(self, rid: str | None, name: str) -> None:
        if rid is not None:
            self.chosen[rid] = name
            while len(self.chosen) > MAX_REMEMBERED:  # requests cancelled before they were routed
                self.chosen.popitem(last=False)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self.forget(replica_id.unique_id)

    # ---- state -------------------------------------------------------------------------
    def router(self, policy: str) -> Router | None:
        """The Router of a policy (None for prefix until a replica has said how it hashes)."""
        if policy not in self.routers:
            if policy == "prefix" and self.hasher is None:
                return None
            self.routers[policy] = Router(policy, self.index, self.hasher, self.groups, **self.costs)
        return self.routers[policy]

    def load(self, replica: RunningReplica) -> ReplicaLoad:
        """Requests on the replica (Serve's count) and its KV usage (its last routing stats)."""
        depth = self.replica_queue_len_cache.get(replica.replica_id) or 0
        usage = float((replica.routing_stats or {}).get("kv_usage", 0.0))
        return ReplicaLoad(queue_depth=depth, kv_usage=usage)

    def sync(self) -> None:
        """Subscribe to new replicas, forget gone ones, read what the feeds hold."""
        live = {replica_name(r): r for r in self._replicas.values()}
        for name in [n for n in self.feeds if n not in live]:
            self.forget(name)
        for name, replica in live.items():
            if name not in self.feeds:
                self.subscribe(name, replica.replica_metadata)
        for feed in list(self.feeds.values()):
            feed.poll(0)
        if self.poller is None:
            self.loop = asyncio.get_running_loop()
            self.poller = self.loop.create_task(self.poll_forever())

    def subscribe(self, name: str, meta: dict) -> None:
        """Follow one replica's KV events (replicas share one hashing: the first one's is kept)."""
        if "kv_events" not in meta:
            return
        if self.hasher is None:
            self.hasher = PromptHasher(bytes.fromhex(meta["namespace"]), meta["block_size"], meta["hash_algo"])
            self.groups = tuple(meta["hit_groups"])
        self.replays[name] = ReplayClient(meta["kv_events_replay"], timeout_s=2.0)
        self.feeds[name] = EventFeed(self.index, name, meta["kv_events"])
        for seq, payload in self.replays[name].fetch(0):  # what it published before we listened
            self.index.feed(name, seq, payload)
        log.info("router: following replica %s's KV events on %s", name, meta["kv_events"])

    def forget(self, name: str) -> None:
        """Stop following a replica and drop every block the index says it held."""
        feed = self.feeds.pop(name, None)
        if feed is not None:
            feed.close()
            log.info("router: replica %s is gone; its blocks leave the index", name)
        self.replays.pop(name, None)
        self.index.drop_replica(name)

    def _replay(self, name: str, start: int) -> list[tuple[int, bytes]]:
        client = self.replays.get(name)
        return client.fetch(start) if client is not None else []

    async def poll_forever(self) -> None:
        """Read every feed every POLL_SECONDS, so the index keeps up between requests."""
        while True:
            await asyncio.sleep(POLL_SECONDS)
            try:
                self.sync()
            except Exception:
                log.exception("router: reading KV events failed")

    async def status(self, hashes: bool = False) -> dict:
        """Each live replica: its load and the blocks the index says it holds (on the router's loop)."""
        self.sync()
        out = {}
        for replica in self._replicas.values():
            name = replica_name(replica)
            blocks = self.index.replicas.get(name)
            load = self.load(replica)
            entry = {"actor_name": replica.replica_id.to_full_id_str(), "node": meta_of(replica).get("node"),
                     "queue_depth": load.queue_depth,
                     "kv_usage": load.kv_usage, "following_events": name in self.feeds,
                     "lost_batches": blocks.lost_batches if blocks else 0,
                     "blocks": {str(g): len(h) for g, h in (blocks.groups.items() if blocks else [])}}
            if hashes:
                entry["hashes"] = {str(g): sorted(x.hex() for x in h)
                                   for g, h in (blocks.groups.items() if blocks else [])}
            out[name] = entry
        return {"policy": self.policy, "replicas": out}


def router_key(app: str, deployment: str) -> str:
    """The name a deployment's router goes by in `routers()`."""
    return f"{app}/{deployment}"


def routers() -> dict[str, KVRouter]:
    """This process's routers by `router_key`. Looked up by module name: Ray may ship a class by value,
    with its own copy of the globals it uses."""
    return importlib.import_module(__name__).ROUTERS


def route_info(pending_request: PendingRequest | None) -> RouteInfo:
    """The RouteInfo a request carries as its first argument (an empty one if none)."""
    args = pending_request.args if pending_request is not None else []
    first = args[0] if args else None
    return getattr(first, "route", None) or RouteInfo()
