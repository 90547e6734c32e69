"""The weight cache: every tensor of a built kept-format model (GGUF layouts packed for the kernels,
fused groups, bfloat16 copies) in one file, so a second start maps them back instead of rebuilding.

The file is `torch.save` of a flat dict {slot name: tensor}, read with `torch.load(mmap=True,
weights_only=True)`: no copy, pages read on demand (copy-on-write, so the file is never changed).
A model is first built on the meta device with the same code as a fresh build (its layers' kernels
picked for the device it will run on), then each of its tensors is replaced by the cached one of
the same slot, shape and dtype. The file name carries a key of everything that changes the bytes
(`cache_key`); it lives in the model file's cache folder (loader.cache_dir_for).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

from kvserve.model.loader import _atomic_write, cache_dir_for
from kvserve.native import cpu_flags

log = logging.getLogger("kvserve")

FORMAT_VERSION = "2"
SOURCES = Path(__file__).parent   # kvserve/model: the code that decides every layout and layer
# the files whose code lays out the kept tensors: the layers, and the C++ ops that tile their codes
LAYOUT_SOURCES = ("*.py", "cpu/*.cpp")


def cache_key(**fields) -> str:
    """"<config>-<build>": a digest of `fields` (the weight format config, dtype, device), then one of
    the torch version and its CPU capability (its int4 pack layout), the CPU flags and the sources
    that lay the tensors out (what an upgrade changes: `save` drops the config's files of other builds)."""
    sources = hashlib.sha256()
    for file in sorted(f for pattern in LAYOUT_SOURCES for f in SOURCES.glob(pattern)):
        sources.update(file.read_bytes())
    build = {"version": FORMAT_VERSION, "torch": torch.__version__, "cpu": cpu_flags(),
             "capability": torch.backends.cpu.get_cpu_capability(), "sources": sources.hexdigest()}
    return f"{_digest(fields)}-{_digest(build)}"


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cache_file(model_path: str, key: str, cache_root: str | Path | None = None) -> Path:
    """Where the weight cache of `model_path` built under `key` lives."""
    return cache_dir_for(model_path, cache_root) / f"built-{key}.pt"


def slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, str]]:
    """Every tensor `model` holds: name -> (module, "_parameters" or "_buffers", attribute); the
    layers of fused groups (not submodules) under `<module>.fused.<i>.quant`."""
    out = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, sub in module.named_modules(prefix=prefix):
            for table in ("_parameters", "_buffers"):
                for attr, t in getattr(sub, table).items():
                    if t is not None:
                        out[f"{name}.{attr}"] = (sub, table, attr)
            for i, group in enumerate(getattr(sub, "fused", ())):
                if group.quant is not None:
                    visit(f"{name}.fused.{i}.quant", group.quant)
    visit("", model)
    return out


def save(model: nn.Module, file: Path) -> None:
    """Write every tensor of `model` to `file` (atomically; a failure is logged, not raised)."""
    state = {name: getattr(sub, table)[attr] for name, (sub, table, attr) in slots(model).items()}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(file, lambda tmp: torch.save({k: v.detach() for k, v in state.items()}, tmp))
    except (OSError, RuntimeError) as exc:
        log.warning("could not write the weight cache %s: %s", file, exc)
        return
    _drop_stale(file)


def _drop_stale(file: Path) -> None:
    """Delete the files beside `file` that no start of this build will read: the same config's under
    another build (an earlier kvserve, torch or CPU), and those named before keys had two parts. A
    process still mapping one keeps its pages (the file goes when it unmaps)."""
    config = file.stem.removeprefix("built-").split("-")[0]
    for other in file.parent.glob("built-*.pt"):
        parts = other.stem.removeprefix("built-").split("-")
        if other != file and (len(parts) != 2 or parts[0] == config):
            try:
                other.unlink()
                log.info("removed the stale weight cache %s", other.name)
            except OSError as exc:
                log.warning("could not remove the stale weight cache %s: %s", other, exc)


def load(model: nn.Module, file: Path) -> bool:
    """Give `model` (built on the meta device) the tensors of `file`, slot by slot; False (the model
    untouched) when the file is missing, unreadable or holds other slots, shapes or dtypes."""
    if not file.is_file():
        return False
    try:
        state = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
        places = slots(model)
        _check(places, state)
    except Exception as exc:   # a corrupt or foreign file: rebuild
        log.warning("ignoring the weight cache %s (%s): building the weights", file, exc)
        return False
    new = {}   # one tensor per shared one (a tied head's codes are the embedding's)
    for name, (sub, table, attr) in places.items():
        old = getattr(sub, table)[attr]
        if id(old) not in new:
            t = state[name]
            new[id(old)] = nn.Parameter(t, requires_grad=old.requires_grad) if table == "_parameters" else t
        getattr(sub, table)[attr] = new[id(old)]
    return True


def _check(places: dict, state) -> None:
    if not isinstance(state, dict) or set(state) != set(places):
        raise ValueError("it holds other tensors than this model")
    for name, (sub, table, attr) in places.items():
        old, t = getattr(sub, table)[attr], state[name]
        if not isinstance(t, torch.Tensor) or t.shape != old.shape or t.dtype != old.dtype:
            raise ValueError(f"{name} differs from this model's")
