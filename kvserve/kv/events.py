"""KV events: what the prefix cache gains and loses, published over ZeroMQ for routers and indexers.

The KV manager records an event where a block's hash enters the prefix cache (`BlockStored`),
where a cached block is reused for new data (`BlockRemoved`) and where the cache is reset
(`AllBlocksCleared`, or `BlockRemoved` when blocks still held by requests keep their hashes). The
events of one engine step go out together as one batch, with a sequence number and a timestamp,
in the wire format of vLLM's KVEventsConfig / ZmqEventPublisher (docs/SERVING.md "KV events"):

- a PUB socket sends each batch as three frames: topic, sequence number (8 bytes, big-endian),
  msgpack payload `[ts, [event, ...]]`; each event is an array whose first item names its type:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, group]`,
  `["BlockRemoved", block_hashes, medium, group]`, `["AllBlocksCleared"]`;
- a ROUTER socket (optional) answers a start sequence number (8 bytes, big-endian) with every
  buffered batch from that number on, each as (sequence number, payload), then an end marker
  (sequence number -1, empty payload).

Block hashes are the chained hashes of kv/hashing.py (bytes), the same for every KV group; `group`
says which group's block it is. A background thread owns the sockets: the step thread only queues.
pyzmq and msgpack come with the `events` extra and are imported when events are turned on.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.extras import require
from kvserve.kv.hashing import BlockHash

log = logging.getLogger("kvserve")

MEDIA = ("device", "cpu", "disk", "redis")
DEFAULT_TOPIC = b"kv-events"
DEFAULT_BUFFER_STEPS = 10_000        # batches the replay socket keeps
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ENDPOINT = re.compile(r"(tcp://(\*|\[[0-9a-fA-F:.]+\]|[\w.-]+):\d{1,5}|ipc://.+|inproc://.+)")


def check_endpoint(name: str, value: str | None, allow_remote: bool = True) -> None:
    """ValueError naming option `name` unless `value` is None or a ZeroMQ endpoint to bind (one only
    this machine reaches unless `allow_remote`)."""
    if value is None:
        return
    if not isinstance(value, str) or not _ENDPOINT.fullmatch(value):
        raise ValueError(f"{name} must be a ZeroMQ endpoint to bind, such as 'tcp://127.0.0.1:5557', "
                         f"'tcp://*:5557' or 'ipc:///tmp/kv-events', got {value!r}")
    if value.startswith("tcp://") and not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"{name}: the port of {value!r} must be in 1-65535")
    if not allow_remote and not is_local(value):
        raise ValueError(f"{name}: {value!r} can be reached from other machines, and KV events carry the "
                         "token ids of every prompt (every tenant's) with no authentication: bind a loopback "
                         "address such as 'tcp://127.0.0.1:5557' or an ipc:// path, or pass "
                         "--kv-events-allow-remote (kv_events_allow_remote=True) on a trusted network")


def is_local(endpoint: str) -> bool:
    """True for an endpoint only this machine reaches: ipc://, inproc://, a loopback tcp:// address."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # '*', an interface or host name: not known to be loopback
        return False


@dataclass
class BlockStored:
    """Full blocks newly registered in the prefix cache, parent first (one chain)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = "device"
    group: int = 0

    def wire(self) -> list:
        return ["BlockStored", self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium, self.group]


@dataclass
class BlockRemoved:
    """Blocks whose hashes left the prefix cache of `medium`."""

    block_hashes: list[BlockHash]
    medium: str = "device"
    group: int = 0

    def wire(self) -> list:
        return ["BlockRemoved", self.block_hashes, self.medium, self.group]


@dataclass
class AllBlocksCleared:
    """Every cached block of the engine was forgotten."""

    def wire(self) -> list:
        return ["AllBlocksCleared"]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventQueue:
    """Events recorded since the last `take` (appends may come from any thread)."""

    events: list[KVEvent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, event: KVEvent) -> None:
        with self.lock:
            if isinstance(event, AllBlocksCleared):
                self.events.clear()  # nothing recorded before it matters to a consumer
            self.events.append(event)

    def take(self) -> list[KVEvent]:
        with self.lock:
            events, self.events = self.events, []
        return events


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    """The msgpack payload of one batch: [ts, [event, ...]]."""
    msgpack = require("msgpack", "events", "KV events")
    return msgpack.packb([ts, [e.wire() for e in events]], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[list]]:
    """(ts, events as wire arrays) of one payload; for consumers and tests."""
    msgpack = require("msgpack", "events", "KV events")
    ts, events = msgpack.unpackb(payload, raw=False)
    return ts, events


class KVEventPublisher:
    """Publishes each step's events as one numbered batch on a PUB socket, and answers replay requests.

    The sockets are bound here (a bad or busy endpoint raises ValueError at once) and then owned by
    a daemon thread; `flush` (once per engine step) only hands the batch over."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = DEFAULT_TOPIC,
                 buffer_steps: int = DEFAULT_BUFFER_STEPS):
        check_endpoint("kv_events", endpoint)
        check_endpoint("kv_events_replay", replay_endpoint)
        if replay_endpoint is not None and replay_endpoint == endpoint:
            raise ValueError(f"kv_events_replay must differ from kv_events (both {endpoint!r})")
        zmq = require("zmq", "events", "KV events")
        require("msgpack", "events", "KV events")
        self.events = KVEventQueue()
        self.topic = topic
        self.seq = 0                      # the next batch's sequence number
        self._ctx = zmq.Context()
        self._pub = self._bind(zmq.PUB, endpoint, "kv_events")
        self._replay = self._bind(zmq.ROUTER, replay_endpoint, "kv_events_replay") if replay_endpoint else None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def _bind(self, kind: int, endpoint: str, name: str):
        sock = self._ctx.socket(kind)
        sock.setsockopt(require("zmq", "events", "KV events").LINGER, 0)
        try:
            sock.bind(endpoint)
        except Exception as e:
            sock.close()
            self._close_sockets()
            raise ValueError(f"{name}: cannot bind {endpoint!r} ({e}); give a free local address "
                             "such as 'tcp://127.0.0.1:5557'") from None
        return sock

    def flush(self) -> int | None:
        """Publish the events recorded since the last flush as one batch; its sequence number, or None."""
        events = self.events.take()
        if not events or self._stop.is_set():
            return None
        seq, self.seq = self.seq, self.seq + 1
        self._outbox.put((seq, encode_batch(time.time(), events)))
        return seq

    def close(self, timeout: float = 5.0) -> None:
        """Send what was flushed, stop the thread and close the sockets."""
        if self._stop.is_set():
            return
        self.flush()
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        zmq = require("zmq", "events", "KV events")
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                stopping = self._stop.is_set()
                self._send_pending()
                if stopping:
                    return
                if self._replay is None:
                    time.sleep(0.005)
                elif poller.poll(5):
                    self._answer_replay()
        except Exception:
            log.exception("KV events: the publisher thread failed; no more events are sent")
        finally:
            self._close_sockets()

    def _send_pending(self) -> None:
        while True:
            try:
                seq, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._buffer.append((seq, payload))
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], frames[-1]
        if len(start) != 8:
            log.warning("KV events: a replay request of %d bytes (expected an 8-byte sequence number)", len(start))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
            return
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for name in ("_pub", "_replay"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(0)
        self._ctx.term()


def build_publisher(endpoint: str | None, replay_endpoint: str | None) -> KVEventPublisher | None:
    """A publisher on `endpoint` (None when events are off); the KV manager and the tiers are built
    with its queue (`publisher.events`)."""
    if endpoint is None:
        return None
    return KVEventPublisher(endpoint, replay_endpoint)
