"""Host memory a CPU engine's malloc holds: glibc, as the engine tunes it, keeps up to 1 GiB of freed
heap per arena for the next step, in a bounded number of arenas; an idle server hands it back."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

from kvserve import SamplingParams
from kvserve.engine.async_engine import AsyncEngine

HEAP_CHURN = textwrap.dedent("""
    import torch
    from kvserve.engine.builder import keep_freed_memory, release_freed_memory

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

    assert keep_freed_memory()
    base = rss_mib()
    chunks = [torch.ones(1 << 20) for _ in range(64)]   # 64 x 4 MiB: heap, below the mmap threshold
    held = rss_mib()
    del chunks
    kept = rss_mib()
    released = release_freed_memory()
    print(base, held, kept, rss_mib(), released)
""")


THREAD_ARENAS = textwrap.dedent("""
    import ctypes, sys, threading
    from kvserve.engine.builder import keep_freed_memory

    if sys.argv[1] == "tuned":
        assert keep_freed_memory()
    barrier = threading.Barrier(13)

    def worker():
        data = [bytearray(10000) for _ in range(10)]   # from this thread's arena
        barrier.wait()
        barrier.wait()

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    barrier.wait()
    ctypes.CDLL("libc.so.6").malloc_stats()             # one "Arena N:" paragraph per arena, on stderr
    barrier.wait()
""")


def arenas(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", THREAD_ARENAS, mode], capture_output=True, text=True, check=True)
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


def test_threads_share_a_bounded_number_of_arenas():
    from kvserve.engine.builder import MALLOC_ARENAS

    assert arenas("glibc") > MALLOC_ARENAS     # glibc alone: an arena per thread (up to 8 per core)
    assert 1 <= arenas("tuned") <= MALLOC_ARENAS


def test_freed_heap_is_kept_until_released():
    out = subprocess.run([sys.executable, "-c", HEAP_CHURN], capture_output=True, text=True, check=True)
    base, held, kept, after, released = out.stdout.split()
    base, held, kept, after = map(float, (base, held, kept, after))
    assert held - base > 200                   # 256 MiB written
    assert kept - base > 200                   # freed, but kept for reuse
    assert released == "True" and after - base < 64


def test_an_idle_engine_releases_once_per_busy_spell(llm, monkeypatch):
    calls: list[float] = []
    monkeypatch.setattr(llm.engine, "_release_memory", lambda: calls.append(time.monotonic()) or True)

    async def spell(aengine) -> float:
        stream = await aengine.add("The cache", SamplingParams(max_tokens=8, temperature=0), f"r{len(calls)}-{time.monotonic()}")
        async for _ in stream:
            pass
        return time.monotonic()

    async def run():
        aengine = AsyncEngine(llm.engine, idle_release_seconds=0.3)
        aengine.start()
        done = await spell(aengine)
        assert calls == []                     # released only after the idle delay
        for _ in range(10):                    # commands while idle do not put the release off
            await aengine.get_metrics()
            await asyncio.sleep(0.1)
        assert len(calls) == 1 and calls[0] - done >= 0.25
        await asyncio.sleep(0.5)
        assert len(calls) == 1                 # once per busy spell, not every idle wake-up
        done = await spell(aengine)
        await asyncio.sleep(0.8)
        assert len(calls) == 2 and calls[1] - done >= 0.25
        await aengine.shutdown()

    asyncio.run(run())
