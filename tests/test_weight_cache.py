"""The weight cache (model/weight_cache.py): a second build maps a built kept-format model's tensors
back from one file, bit-identical to a fresh build; its key follows what changes the bytes; a
corrupt or foreign file is ignored with a warning and rebuilt. And the int4 layers' fast bfloat16
copy equals the dequantize-based one exactly."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from test_gguf_formats import _logits, mixed_gguf  # noqa: F401  (a fixture)

from kvserve.config import EngineConfig
from kvserve.engine import builder
from kvserve.model import weight_cache
from kvserve.model.gguf_blocks import Int4Groups
from kvserve.model.loader import load_gguf_kept
from kvserve.model.quant import Int4GroupLinear, make_linear, weight_bytes

CPU = torch.device("cpu")
CONFIG = EngineConfig(bf16_weight_copy="on")   # every int8/int4/int8-group layer takes its copy


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """XDG_CACHE_HOME for this module's builds (the weight cache lives under it)."""
    home = tmp_path_factory.mktemp("xdg")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    yield home
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


def build(path: str):
    mc, floats, kept = load_gguf_kept(path)
    return builder._cached_kept_model(CONFIG, path, mc, floats, kept, CPU, torch.float32)


def the_file(path: str):
    key = weight_cache.cache_key(weights="gguf", dtype=torch.float32, device="cpu", bf16_weight_copy="on")
    return weight_cache.cache_file(path, key)


def phases(caplog) -> list[str]:
    return [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("start-up: ")]


@pytest.fixture(scope="module")
def fresh(mixed_gguf, cache_home):  # noqa: F811
    """A fresh build of the mixed file (which writes the cache) and its logits."""
    model = build(mixed_gguf)
    assert the_file(mixed_gguf).is_file()
    vocab = model.model.embed_tokens.num_embeddings
    ids = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0))
    return model, ids, _logits(model, ids)


def assert_same_build(a, b) -> None:
    sa, sb = weight_cache.slots(a), weight_cache.slots(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        ta = getattr(sa[name][0], sa[name][1])[sa[name][2]]
        tb = getattr(sb[name][0], sb[name][1])[sb[name][2]]
        assert not tb.is_meta and tb.dtype == ta.dtype and torch.equal(ta, tb), name
    assert weight_bytes(a) == weight_bytes(b)


def test_a_second_build_maps_the_cache_back_bit_identical(mixed_gguf, fresh, caplog):  # noqa: F811
    model, ids, want = fresh
    assert any(m.bf16_t is not None for m in builder.quant_layers(model))
    with caplog.at_level(logging.INFO, logger="kvserve"):
        second = build(mixed_gguf)
    assert "bf16" not in phases(caplog) and "build" not in phases(caplog)   # nothing rebuilt
    assert_same_build(model, second)
    assert second.lm_head.tiles.data_ptr() == second.model.embed_tokens.tiles.data_ptr()   # still shared
    assert torch.equal(_logits(second, ids), want)
    assert torch.equal(_logits(second, ids[:5]), _logits(model, ids[:5]))


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_with_a_warning_and_rebuilt(mixed_gguf, fresh, caplog, damage):  # noqa: F811
    model, ids, want = fresh
    file = the_file(mixed_gguf)
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        torch.save({"model.norm.weight": torch.zeros(3)}, file)
    with caplog.at_level(logging.INFO, logger="kvserve"):
        rebuilt = build(mixed_gguf)
    assert any(r.levelno == logging.WARNING and "ignoring the weight cache" in r.getMessage() for r in caplog.records)
    assert "bf16" in phases(caplog)
    assert_same_build(model, rebuilt)
    assert torch.equal(_logits(rebuilt, ids), want)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvserve"):
        mapped = build(mixed_gguf)        # the rebuilt file was written again
    assert not any(r.levelno == logging.WARNING for r in caplog.records) and "bf16" not in phases(caplog)
    assert_same_build(model, mapped)


def test_the_key_changes_with_the_config_torch_cpu_sources_and_file_and_not_otherwise(mixed_gguf, tmp_path,  # noqa: F811
                                                                                     monkeypatch):
    fields = dict(weights="gguf", dtype=torch.float32, device="cpu", bf16_weight_copy="auto")
    key = weight_cache.cache_key(**fields)
    assert weight_cache.cache_key(**fields) == key
    for name, other in [("dtype", torch.bfloat16), ("bf16_weight_copy", "off"), ("device", "cuda")]:
        assert weight_cache.cache_key(**{**fields, name: other}) != key, name
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "x")
    assert weight_cache.cache_key(**fields) != key
    monkeypatch.undo()
    monkeypatch.setattr(weight_cache, "cpu_flags", lambda: "flags : other")
    assert weight_cache.cache_key(**fields) != key
    monkeypatch.undo()
    sources = tmp_path / "src"
    shutil.copytree(weight_cache.SOURCES, sources, ignore=shutil.ignore_patterns("__pycache__", "native", "*.so"))
    monkeypatch.setattr(weight_cache, "SOURCES", sources)
    assert weight_cache.cache_key(**fields) == key
    for changed in ("quant.py", "cpu/gemv.cpp"):   # the layers, the C++ that tiles their codes
        (sources / changed).write_text((sources / changed).read_text() + "\n// changed\n")
        assert weight_cache.cache_key(**fields) != key, changed
        key = weight_cache.cache_key(**fields)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(mixed_gguf, copy)
    assert weight_cache.cache_file(str(copy), key) != weight_cache.cache_file(mixed_gguf, key)
    assert weight_cache.cache_file(mixed_gguf, key) == weight_cache.cache_file(mixed_gguf, key)


@pytest.mark.parametrize("n", [128, 48])
def test_the_fast_bf16_copy_equals_the_dequantize_based_one(n):
    g = torch.Generator().manual_seed(n)
    k = 256
    groups = Int4Groups(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                        torch.rand(n, k // 32, generator=g) * 0.1, torch.randn(n, k // 32, generator=g) * 0.5)
    layer = make_linear(groups, None, "int4")
    assert isinstance(layer, Int4GroupLinear)
    want = layer.dequantize(torch.float32).t().contiguous().to(torch.bfloat16)
    layer.add_bf16_copy()
    assert layer.bf16_t.is_contiguous() and torch.equal(layer.bf16_t, want)


def test_writing_the_cache_drops_this_configs_files_of_other_builds(mixed_gguf, tmp_path):  # noqa: F811
    """An upgrade (another torch, CPU or kvserve source) writes a new file; writing it removes the same
    config's files of other builds and the files named before keys had two parts, and keeps other
    configs' files (another dtype or copy setting is still read by starts that ask for it)."""
    key = weight_cache.cache_key(weights="gguf", dtype=torch.float32, device="cpu", bf16_weight_copy="on")
    config, build_part = key.split("-")
    other_config = weight_cache.cache_key(weights="gguf", dtype=torch.bfloat16, device="cpu", bf16_weight_copy="on")
    assert other_config.split("-")[0] != config and other_config.split("-")[1] == build_part
    file = weight_cache.cache_file(mixed_gguf, key, tmp_path)
    file.parent.mkdir(parents=True)
    stale = [file.with_name(f"built-{config}-{'0' * 12}.pt"), file.with_name(f"built-{'a' * 20}.pt")]
    kept = [file.with_name(f"built-{other_config}.pt"), file.with_name(f"built-{other_config.split('-')[0]}-{'0' * 12}.pt")]
    for f in stale + kept:
        f.write_bytes(b"old")
    weight_cache.save(torch.nn.Linear(4, 4), file)
    assert file.is_file() and all(f.is_file() for f in kept) and not any(f.exists() for f in stale)
