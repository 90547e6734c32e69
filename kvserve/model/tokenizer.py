"""Tokenizer: a transformers fast tokenizer with its chat template, cached for GGUF models."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvserve.model.loader import cache_dir_for, is_gguf, resolve_model_path

logger = logging.getLogger("kvserve")

CACHE_TOKENIZER = "tokenizer"


class Tokenizer:
    """Text <-> token ids and chat formatting for one model."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer

    @classmethod
    def load(cls, path: str | None, *, cache_root: str | Path | None = None) -> Tokenizer:
        """Load the tokenizer of a GGUF file (cached after the first build) or HF directory."""
        from transformers import AutoTokenizer

        start = time.perf_counter()
        resolved = resolve_model_path(path)
        if is_gguf(resolved):
            hf_tokenizer, source = _load_gguf_tokenizer(resolved, cache_root)
        else:
            hf_tokenizer, source = AutoTokenizer.from_pretrained(resolved), resolved
        logger.info("loaded tokenizer in %.2f s from %s", time.perf_counter() - start, source)
        return cls(hf_tokenizer)

    @property
    def hf_tokenizer(self):
        """The wrapped transformers tokenizer."""
        return self._tok

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token (None when the tokenizer has none)."""
        return self._tok.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token (None when the tokenizer has none)."""
        return self._tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        """True when the model ships a chat template."""
        return bool(self._tok.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token `ids`."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        """Vocabulary strings of token `ids`."""
        return self._tok.convert_ids_to_tokens(ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation formatted by the model's chat template."""
        if not self.has_chat_template:
            raise ValueError(
                "This model has no chat template; send a plain prompt (completions) instead of messages."
            )
        ids = self._tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        return list(ids)


def _load_gguf_tokenizer(path: str, cache_root) -> tuple[object, str]:
    from transformers import AutoTokenizer

    target = cache_dir_for(path, cache_root) / CACHE_TOKENIZER
    if (target / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(target)), f"cache {target}"
        except Exception as exc:
            logger.warning("ignoring unreadable tokenizer cache %s: %s", target, exc)
    hf_tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        _save_atomically(hf_tokenizer, target)
    except OSError as exc:
        logger.warning("could not write tokenizer cache %s: %s", target, exc)
    return hf_tokenizer, f"GGUF (cache written to {target})"


def _save_atomically(hf_tokenizer, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        hf_tokenizer.save_pretrained(str(tmp))
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
