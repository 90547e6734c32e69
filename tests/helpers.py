"""Comparison helpers shared by the engine tests, and a server on a loopback port."""

import socket
import threading
import time
from contextlib import contextmanager

TOL = 1e-4  # float32 log-prob tolerance between cached and recomputed paths


def assert_same_completions(a, b, tol=TOL):
    """Same tokens and (when present) log-probs within `tol`, for lists of RequestOutput."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert len(ra.outputs) == len(rb.outputs)
        for ca, cb in zip(ra.outputs, rb.outputs):
            assert ca.token_ids == cb.token_ids, (ca.text, cb.text)
            assert ca.text == cb.text
            if ca.logprobs is not None:
                for step, (la, lb) in enumerate(zip(ca.logprobs, cb.logprobs)):
                    assert la.keys() == lb.keys(), step
                    for tok in la:
                        assert abs(la[tok].logprob - lb[tok].logprob) < tol, (step, tok)


def all_blocks_free(llm) -> bool:
    """True when no request holds a block."""
    m = llm.get_metrics()
    return m["num_blocks_free"] == m["num_blocks_total"] and m["num_requests_running"] == 0


class PoisonedSampler:
    """The engine's sampler, but rows of requests seeded 1000 + k get NaN logits at output token k."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, logits, inputs, bitmask=None):
        logits = logits.clone()
        for row, inp in enumerate(inputs):
            seed = inp.params.seed
            if seed is not None and seed >= 1000 and len(inp.output_token_ids) == seed - 1000:
                logits[row] = float("nan")
        return self.real(logits, inputs, bitmask)


def tier_keys(engine, token_ids: list[int]) -> list[str]:
    """The tier key of each full block of `token_ids` (no cache salt, group 0) under `engine`'s tiers."""
    from kvserve.kv.hashing import hash_full_blocks
    kv = engine.kv
    hashes = hash_full_blocks(kv.namespace, token_ids, kv.block_size, algo=kv.hash_algo)
    return [engine.tiers.key(h) for h in hashes]


def poison_entry(path, seed: int = 0) -> None:
    """Replace a CRC-sealed tier entry's payload with random bytes and fix up its CRC-32: an entry every
    check passes whose K/V are garbage (NaN and huge values among them)."""
    import random
    import struct
    import zlib
    data = path.read_bytes()
    (hlen,) = struct.unpack("<I", data[4:8])
    start = 8 + hlen
    body = data[:start] + random.Random(seed).randbytes(len(data) - 4 - start)
    path.write_bytes(body + struct.pack("<I", zlib.crc32(body)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_on_free_port(app, **options):
    import uvicorn
    return uvicorn.Config(app, **{"host": "127.0.0.1", "port": free_port(), "log_level": "warning", **options})


@contextmanager
def serving(app, **options):
    """The app on a loopback port in a background thread (uvicorn.Config `options`); yields its base URL."""
    import uvicorn
    config = config_on_free_port(app, **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def int16_rows(x):
    """x's rows as the CPU GEMVs for GGUF codes multiply them (q4g_gemv, q8g_gemv): int16 codes per
    block of 32 (d = max|x| / 32767), widened back: codes * d."""
    import torch
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    d = xb.abs().amax(-1) * torch.tensor(1 / 32767, dtype=torch.float32)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv[..., None]).clamp(-32767, 32767) * d[..., None]).view(m, k)


def int16_row_error(x, w):
    """The most int16_rows can move x W^T (w [N, K]): per value half a step, d / 2."""
    m, k = x.shape
    half_step = (x.double().view(m, k // 32, 32).abs().amax(-1) / 65534).repeat_interleave(32, 1)
    return half_step @ w.double().abs().t()


def assert_saved_alike(tokenizer_folder, reference) -> None:
    """The files a cached tokenizer folder holds equal those transformers' `reference` tokenizer saves."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as ref_folder:
        reference.save_pretrained(ref_folder)
        names = sorted(p.name for p in Path(ref_folder).iterdir())
        assert names == sorted(p.name for p in Path(tokenizer_folder).iterdir())
        for name in names:
            assert (Path(tokenizer_folder) / name).read_text() == (Path(ref_folder) / name).read_text(), name
