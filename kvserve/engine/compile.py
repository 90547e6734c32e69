"""Compiling the model at start-up without holding the first token behind it.

An engine starts with the model eager (the same weights, the C++ GEMVs). `StartupCompile` compiles
the dense regions and the one-token graphs (model/regions.py) and the LM head's one-row kernel,
either before the engine serves (compile_mode="blocking") or on a thread while the engine serves
eagerly (compile_mode="background"); the engine puts the compiled parts in place between two steps.
The thread starts once the first step has run (or after IDLE_START seconds without one, or when
someone waits for it): importing and tracing is Python work that would share the interpreter with
the first request's prefill and first token.
The warm-up runs through copies of the layers and over pools shaped like the engine's, so it never
writes what the engine's steps read.

Inductor's artifacts (generated kernels, AOTAutograd graphs) persist across processes as one
Mega-Cache file (torch.compiler.save_cache_artifacts) under ~/.cache/kvserve/compiled, keyed by
everything that changes them: the model file, the engine config, torch, Python, kvserve's sources
and the CPU's flags.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import hashlib
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.config import EngineConfig
from kvserve.model.quant import HalfLinear
from kvserve.model.regions import compiled_regions, warm_up
from kvserve.native import cpu_flags
from kvserve.paths import default_cache_root

log = logging.getLogger("kvserve")

SOURCES = Path(__file__).resolve().parents[1]       # the kvserve package
THREAD_NAME = "kvserve-compile"
IDLE_START = 2.0   # seconds after start-up without a step at which a background compile starts anyway
# the resolved model file is keyed instead; both modes build the same graphs; a tier key is a secret
# that changes no graph
KEY_EXCLUDED = ("model", "compile_mode", "kv_tier_key", "kv_tier_key_file")


def artifact_key(config: EngineConfig, model_path: str, torch_version: str = torch.__version__,
                 cpu: str | None = None) -> str:
    """The name of the compiled artifacts of `config` over the model file at `model_path`."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in KEY_EXCLUDED}
    parts = [repr(sorted(fields.items())), _file_signature(Path(model_path)), torch_version, sys.version,
             _sources_digest(), cpu_flags() if cpu is None else cpu]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def _file_signature(path: Path) -> str:
    """Path, size and modification time of a model file, or of every file in a model folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return "\n".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def _sources_digest() -> str:
    """A digest of kvserve's Python sources (the code the graphs are traced from)."""
    digest = hashlib.sha256()
    for p in sorted(SOURCES.rglob("*.py")):
        digest.update(p.read_bytes())
    return digest.hexdigest()


class ArtifactCache:
    """One Mega-Cache file of torch's compiled artifacts."""

    def __init__(self, folder: Path, key: str):
        self.path = folder / f"{key}.bin"
        self.loaded = False

    def load(self) -> bool:
        """Hand the saved artifacts to torch's caches (a graph compiled next is then read, not
        generated); False when there are none or they cannot be read."""
        if not self.path.exists():
            return False
        try:
            torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as exc:   # a file written by another torch, or cut short
            log.warning("compiled artifacts %s ignored (%s: %s)", self.path, type(exc).__name__, exc)
            return False
        self.loaded = True
        return True

    def save(self) -> None:
        """Write the artifacts this process compiled or read (unless they came from this file)."""
        saved = None if self.loaded else torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(saved[0])
        os.replace(tmp, self.path)
        log.info("compiled artifacts saved to %s (%.1f MiB)", self.path, len(saved[0]) / 2**20)


@dataclass
class CompiledParts:
    """What an engine runs once compiled: the regions, and the LM head with its one-row kernel."""

    regions: object
    head: torch.nn.Module | None


class StartupCompile:
    """Compiles an engine's model (blocking, or on a thread) and installs the result between steps.

    `state`: eager (nothing to compile), compiling, compiled, failed (the engine stays eager)."""

    def __init__(self, engine, mode: str, cache: ArtifactCache | None):
        self.engine = engine
        self.mode = mode
        self.cache = cache
        self.state = "compiling"
        self.seconds = 0.0
        self._ready: CompiledParts | None = None   # set by the compile thread, installed by the step thread
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._launching = threading.Lock()

    @classmethod
    def eager(cls, engine) -> StartupCompile:
        """Nothing to compile: the engine stays eager."""
        startup = cls(engine, "blocking", None)
        startup.state = "eager"
        startup._done.set()
        return startup

    def start(self) -> None:
        """Compile now (blocking) or start the compile thread (background); nothing for an eager engine."""
        if self.state == "eager":
            return
        if self.mode == "blocking":
            self._run()
            self.at_step_boundary()
            return
        log.info("compiling the model in the background from the first step on; steps run eagerly until it is done")
        timer = threading.Timer(IDLE_START, self.launch)
        timer.daemon = True
        timer.start()

    def launch(self) -> None:
        """Start the background compile thread, once (after the first step, when idle, or on wait);
        never while the interpreter exits (no new threads then)."""
        if self._thread is not None or _EXITING.is_set():
            return
        with self._launching:
            if self._thread is None and self.mode == "background" and self.state == "compiling":
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    @property
    def compiled(self) -> bool:
        return self.state == "compiled"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until compiling has finished (or failed), then install the result if it is pending;
        True when the engine now runs compiled. Call from the thread that steps the engine."""
        self.launch()
        self._done.wait(timeout)
        self.at_step_boundary()
        return self.compiled

    def at_step_boundary(self) -> None:
        """Install the compiled parts if the compile thread has finished them (between two steps)."""
        if self._ready is None:
            return
        parts, self._ready = self._ready, None
        model, runner = self.engine.model, self.engine.runner
        model.model.regions = parts.regions
        if parts.head is not None:
            model.lm_head = parts.head
        runner.use_regions(parts.regions)
        self.state = "compiled"
        log.info("start-up: compile/warm-up %.2f s (%s); steps now run the compiled graphs", self.seconds, self.mode)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            parts = self._compile(show_progress=self.mode == "blocking")
        except Exception as exc:  # e.g. no C++ compiler for torch's CPU code generation
            self.state = "failed"
            if _EXITING.is_set():   # the interpreter is exiting: torch refuses new compile work
                log.info("background compile stopped: the process is exiting")
                return
            log.warning("compiled regions: compiling failed (%s: %s); the model runs eagerly "
                        "(enforce_eager=True skips the attempt)", type(exc).__name__, str(exc).splitlines()[0][:200])
        else:
            self.seconds = time.perf_counter() - t0
            if parts is None:
                self.state = "eager"
            else:
                self._ready = parts
        finally:
            self._done.set()

    def _compile(self, show_progress: bool) -> CompiledParts | None:
        engine = self.engine
        model, runner, device = engine.model, engine.runner, engine.device
        if self.cache is not None and self.cache.load():
            log.info("compiled artifacts read from %s", self.cache.path)
        # where the native decode stack runs decode steps (model/native), no stack graphs for them
        native = runner.captured is not None and runner.captured.stack is not None
        regions = compiled_regions(model, stacks=not native)
        if regions is None:
            return None
        captured = runner.capture(regions)
        warm_up(regions, model, device, captured, show_progress)
        parts = CompiledParts(regions, _head_with_row_kernel(model.lm_head))
        if self.cache is not None:
            self.cache.save()
        return parts


@torch.inference_mode()   # as the steps run it (its graph guards on the grad mode)
def _head_with_row_kernel(head: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of the LM head (sharing its weights) with its compiled one-row kernel, or None when it
    has none (HalfLinear.add_row_kernel)."""
    if not isinstance(head, HalfLinear):
        return None
    shadow = copy.copy(head)
    shadow.__dict__["_buffers"] = dict(head._buffers)
    shadow.add_row_kernel()
    return shadow if shadow.row_kernel is not None else None


def startup_compile(engine, wanted: bool) -> StartupCompile:
    """The engine's start-up compile: none when `wanted` is False, else in its config's compile_mode,
    its artifacts under ~/.cache/kvserve/compiled."""
    if not wanted:
        return StartupCompile.eager(engine)
    cfg = engine.config
    cache = ArtifactCache(default_cache_root() / "compiled", artifact_key(cfg, engine.model_path))
    return StartupCompile(engine, cfg.compile_mode, cache)


def compiling() -> bool:
    """True while a background compile of any engine of this process runs."""
    return any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


# set when the interpreter exits, so a compile that torch stops then is not reported as a failure
_EXITING = threading.Event()


@atexit.register
def _finish_at_exit() -> None:
    """Wait for running compiles before the interpreter shuts down: stopping their threads inside
    torch's C++ code aborts the process. At this point torch accepts no new compile work, so a
    compile that is not done ends quickly (its artifacts are not saved)."""
    _EXITING.set()
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME and thread.is_alive():
            thread.join()
