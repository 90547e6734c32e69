"""A model's display name, from its file or folder name and, for GGUF, its `general.name`."""

from __future__ import annotations

import re
from pathlib import Path

_QUANT_SUFFIX_RE = re.compile(r"[.\-_](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
# words of a training run's tag, not of a model name: ep2, epoch3, mix1, lc100k, step500, ckpt12
_TRAINING_TAG_RE = re.compile(r"^(ep|epoch|mix|lc|step|steps|ckpt|checkpoint|iter|run|seed)\d+\w*$",
                              re.IGNORECASE)


def model_display_name(path: str | Path) -> str:
    """Short name for a model: the GGUF file stem without its quantization tag, or the folder name."""
    path = Path(path)
    if path.suffix.lower() != ".gguf":
        return path.name
    return _QUANT_SUFFIX_RE.sub("", path.stem)


def is_training_tag(name: str) -> bool:
    """True when a GGUF's general.name reads as a training run's tag ("Smollm2 135M 8k Lc100K Mix1 Ep2")."""
    return any(_TRAINING_TAG_RE.match(word) for word in re.split(r"[\s\-_]+", name))


def gguf_display_name(general_name: str | None, path: str | Path) -> str:
    """general.name when it names the model, else the file name (SmolLM2-135M-Instruct.Q4_1.gguf ->
    SmolLM2-135M-Instruct)."""
    name = (general_name or "").strip()
    return name if name and not is_training_tag(name) else model_display_name(path)
