"""KV connectors: move a finished prefill's KV blocks from one engine to another.

vLLM's shape (`--kv-transfer-config '{"kv_connector": ..., "kv_role": ...}'`, `kv_transfer_params`
on requests). A producer (`kv_role` kv_producer or kv_both) saves the full prompt blocks of each
request that asks for it (`kv_transfer_params={"do_remote_decode": true}`) when the request
finishes, and answers with the `kv_transfer_params` a consumer needs (`do_remote_prefill`, where
the blocks are). A consumer (kv_consumer or kv_both), given those params, receives the blocks
into its receive store before the request is queued; the request's prefix lookup then loads them
into the device pool as it loads any tier's blocks (kv/tiers.py `TierBridge`), so the request
prefills only its last partial block.

Blocks travel as tier entries: the pool's own format (quantized formats with their scales), keyed
by the chained block hash (and KV group) under the tier namespace, sealed (CRC-32, or HMAC-SHA256
under `--kv-tier-key`) and checked against the tokens the consumer expects. An engine with other
weights or KV options names other keys: its lookups miss and it recomputes. A load that fails
(the producer gone, a timeout, a refused entry) recomputes the prompt, or under
`kv_load_failure_policy="fail"` fails the request with `KVLoadError` before it is queued.

Two connectors:
- `TierConnector`: through a shared tier (`kv_connector_extra_config.tier`: `redis://...` or
  `disk:/path:SIZE`): the producer writes the blocks there, the consumer reads them back.
- `TcpConnector`: engine to engine over TCP (ZeroMQ): the producer keeps the packed blocks in a
  send buffer of `kv_buffer_size` bytes served from `kv_ip:kv_port`; the consumer asks the
  producer named in the params for them by key and each entry leaves the buffer once sent.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

from kvserve.json_options import json_object
from kvserve.kv.tiers import CpuTier

log = logging.getLogger("kvserve")

CONNECTORS = ("TierConnector", "TcpConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
USAGE = 'give e.g. \'{"kv_connector": "TcpConnector", "kv_role": "kv_both"}\''
DEFAULT_TIMEOUT = 10.0     # seconds a consumer waits for a producer's answer


class KVLoadError(RuntimeError):
    """A request's KV could not be received and kv_load_failure_policy is 'fail'."""


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's KVTransferConfig fields that kvserve uses."""

    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0                     # 0: any free port (the params name the one bound)
    kv_buffer_size: float = 1e9          # bytes of a producer's send buffer (TcpConnector)
    kv_load_failure_policy: str = "recompute"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(value) -> KVTransferConfig | None:
    """A KVTransferConfig from JSON text, a dict or itself; ValueError that names what is wrong."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    value = json_object("kv_transfer_config", value, KVTransferConfig, ("kv_connector", "kv_role"), USAGE)
    cfg = KVTransferConfig(**value)
    _check(cfg)
    return cfg


def _check(cfg: KVTransferConfig) -> None:
    if cfg.kv_connector not in CONNECTORS:
        raise ValueError(f"kv_connector {cfg.kv_connector!r} is not one of {CONNECTORS}")
    if cfg.kv_role not in ROLES:
        raise ValueError(f"kv_role {cfg.kv_role!r} is not one of {ROLES}")
    if cfg.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy {cfg.kv_load_failure_policy!r} is not one of {LOAD_FAILURE_POLICIES}")
    if not 0 <= int(cfg.kv_port) < 65536:
        raise ValueError(f"kv_port must be 0-65535, got {cfg.kv_port}")
    if not cfg.kv_buffer_size > 0:
        raise ValueError(f"kv_buffer_size must be > 0 bytes, got {cfg.kv_buffer_size}")
    if cfg.kv_connector == "TierConnector" and "tier" not in cfg.kv_connector_extra_config:
        raise ValueError('TierConnector needs kv_connector_extra_config {"tier": "redis://HOST:PORT/DB"} '
                         '(or "disk:/shared/path:SIZE"): the tier producer and consumer share')


@dataclass
class TransferStats:
    """What a connector moved."""

    saved_requests: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    received_requests: int = 0
    received_blocks: int = 0
    received_bytes: int = 0
    missing_blocks: int = 0      # asked for, not there (never saved, dropped from a buffer, another namespace)
    load_failures: int = 0       # receives that ended in an error (the producer gone, a timeout)
    receive_seconds: float = 0.0


class ReceiveTier(CpuTier):
    """A consumer's received entries, read once by the prefix lookup (the bridge never writes here)."""

    name = "remote"

    def __init__(self, capacity: int):
        super().__init__(capacity, write_policy="read_only")

    def get(self, key: str) -> bytes | None:
        """The entry, taken out: it lives in the device pool once loaded."""
        with self.lock:
            data = self.entries.pop(key, None)
            if data is not None:
                self.usage_bytes -= len(data)
            return data


class KVConnector:
    """Saves finished prefills' blocks (producer) and receives them ahead of a request (consumer)."""

    def __init__(self, config: KVTransferConfig, bridge, receive: ReceiveTier | None):
        self.config = config
        self.bridge = bridge            # TierBridge: tier keys, packing, the seal
        self.receive_tier = receive     # the consumer's store, first in the bridge's tiers
        self.stats = TransferStats()

    # ---- producer ----------------------------------------------------------------
    def save(self, request_id: str, blocks) -> dict | None:
        """Pack `blocks` ((block id, pool key, tokens), computed) and keep them where consumers find
        them; the kv_transfer_params a consumer needs, or None when this engine does not produce."""
        if not self.config.is_producer:
            return None
        keys = [self.bridge.key(h) for _, h, _ in blocks]
        entries = self.bridge.pack_blocks(blocks) if blocks else []
        self._store(list(zip(keys, entries)))
        self.stats.saved_requests += 1
        self.stats.saved_blocks += len(entries)
        self.stats.saved_bytes += sum(len(e) for e in entries)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.config.engine_id,
                "remote_request_id": request_id, "remote_num_blocks": len(entries), **self._where()}

    def _store(self, items: list[tuple[str, bytes]]) -> None:
        raise NotImplementedError

    def _where(self) -> dict:
        return {}

    # ---- consumer ----------------------------------------------------------------
    def receive(self, pool_keys: list, params: dict) -> int:
        """Bring the entries of `pool_keys` named by a producer's `params` into the receive store;
        how many arrived. KVLoadError under the 'fail' policy when any did not."""
        if not self.config.is_consumer:
            raise ValueError("kv_transfer_params ask for a remote prefill, but this engine's kv_role is "
                             f"{self.config.kv_role!r}: start it with kv_role kv_consumer or kv_both")
        keys = [self.bridge.key(k) for k in pool_keys]
        start = time.perf_counter()
        try:
            got = self._fetch(keys, params) if keys else {}
        except Exception as e:
            self.stats.load_failures += 1
            got, error = {}, f"{type(e).__name__}: {e}"
        else:
            error = None
        self.receive_tier.put_many(list(got.items()))
        s = self.stats
        s.receive_seconds += time.perf_counter() - start
        s.received_requests += 1
        s.received_blocks += len(got)
        s.received_bytes += sum(len(v) for v in got.values())
        # a sliding-window group's producer saves only the blocks its window still held
        expected = min(len(keys), int(params.get("remote_num_blocks", len(keys))))
        missing = max(expected - len(got), 0)
        s.missing_blocks += missing
        if missing or error:
            self._load_failed(missing, expected, params, error)
        return len(got)

    def _load_failed(self, missing: int, total: int, params: dict, error: str | None) -> None:
        where = params.get("remote_host", params.get("remote_engine_id", "the producer"))
        what = f"{missing} of {total} KV blocks did not arrive from {where}" + (f" ({error})" if error else "")
        if self.config.kv_load_failure_policy == "fail":
            raise KVLoadError(f"{what}; kv_load_failure_policy is 'fail': retry the prefill, or start the "
                              "engine with kv_load_failure_policy 'recompute'")
        log.warning("%s: recomputing them", what)

    def _fetch(self, keys: list[str], params: dict) -> dict[str, bytes]:
        raise NotImplementedError

    def metrics(self) -> dict:
        return {"connector": self.config.kv_connector, "role": self.config.kv_role, **asdict(self.stats)}

    def close(self) -> None:
        """Stop serving (producer); nothing to do for the others."""


class TierConnector(KVConnector):
    """Through a tier producer and consumer share (Redis, a shared disk)."""

    def __init__(self, config: KVTransferConfig, bridge, receive: ReceiveTier | None, shared=None):
        super().__init__(config, bridge, receive)
        self.tier = shared   # kv/tiers.py make_tier of kv_connector_extra_config["tier"]

    def _store(self, items):
        self.tier.put_many(items)   # synchronous: the consumer reads them as soon as it has the params

    def _fetch(self, keys, params):
        out = {}
        for k in keys:
            data = self.tier.get(k)
            if data is not None:
                out[k] = data
        return out


class TcpConnector(KVConnector):
    """Engine to engine over TCP: a producer's send buffer served on a ZeroMQ ROUTER socket."""

    def __init__(self, config: KVTransferConfig, bridge, receive: ReceiveTier | None, shared=None):
        super().__init__(config, bridge, receive)
        self.timeout = float(config.kv_connector_extra_config.get("timeout", DEFAULT_TIMEOUT))
        self.buffer = CpuTier(int(config.kv_buffer_size)) if config.is_producer else None
        self.server = _BufferServer(self.buffer, config.kv_ip, int(config.kv_port)) if config.is_producer else None

    def _store(self, items):
        self.buffer.put_many(items)

    def _where(self) -> dict:
        return {"remote_host": self.config.kv_ip, "remote_port": self.server.port}

    def _fetch(self, keys, params):
        host, port = params.get("remote_host"), params.get("remote_port")
        if host is None or port is None:
            raise ValueError("kv_transfer_params lack remote_host / remote_port (the producer's answer names them)")
        return _request_entries(f"tcp://{host}:{int(port)}", keys, self.timeout)

    def metrics(self) -> dict:
        m = super().metrics()
        if self.buffer is not None:
            m["buffer_bytes"] = self.buffer.usage_bytes
            m["buffer_dropped_blocks"] = self.buffer.stats.evictions
        return m

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class _BufferServer:
    """Answers [b"get", keys as JSON] with [found keys as JSON, entry, entry, ...], taking each
    sent entry out of the buffer."""

    def __init__(self, buffer: CpuTier, host: str, port: int):
        import zmq
        self.buffer = buffer
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="kv-connector", daemon=True)
        self.thread.start()
        log.info("KV connector: serving saved blocks on tcp://%s:%d", host, self.port)

    def _serve(self) -> None:
        import zmq
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.sock.recv_multipart()
            ident, body = frames[0], frames[-1]
            try:
                keys = json.loads(body)
                found = [(k, self.buffer.get(k)) for k in keys]
                found = [(k, d) for k, d in found if d is not None]
                for k, _ in found:
                    self.buffer.delete(k)
                reply = [json.dumps([k for k, _ in found]).encode(), *[d for _, d in found]]
            except Exception as e:  # a malformed ask gets an empty answer, never stops the server
                log.warning("KV connector: bad request (%s)", e)
                reply = [b"[]"]
            self.sock.send_multipart([ident, b"", *reply])
        self.sock.close(0)
        self.ctx.term()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)


def _request_entries(endpoint: str, keys: list[str], timeout: float) -> dict[str, bytes]:
    """Ask the producer at `endpoint` for `keys`; TimeoutError when it does not answer in time."""
    import zmq
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(keys).encode())
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no answer from {endpoint} within {timeout:g} s")
        frames = sock.recv_multipart()
    finally:
        sock.close(0)
    found = json.loads(frames[0])
    return dict(zip(found, frames[1:]))


_CONNECTORS = {"TierConnector": TierConnector, "TcpConnector": TcpConnector}


def build_connector(config: KVTransferConfig | None, bridge, receive: ReceiveTier | None, shared=None):
    """The connector `config` names over the engine's TierBridge (`receive`: a consumer's store, the
    first of the bridge's tiers; `shared`: TierConnector's tier), or None without one."""
    if config is None:
        return None
    return _CONNECTORS[config.kv_connector](config, bridge, receive, shared)
