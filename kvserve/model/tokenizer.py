"""Tokenizer: a transformers fast tokenizer with its chat template, cached for GGUF models.

A GGUF model's tokenizer is built by transformers once and saved in the model's cache folder; a
later start reads that folder's tokenizer.json with the `tokenizers` library alone (`FastTokenizer`:
encode, decode and the vocabulary without importing transformers, a second of start-up) and loads
transformers' tokenizer only where it is needed: the chat template and the libraries that take a
transformers tokenizer (grammars, tool parsing)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from kvserve.model.loader import cache_dir_for, is_gguf, resolve_model_path

logger = logging.getLogger("kvserve")

CACHE_TOKENIZER = "tokenizer"
# transformers' model type of each GGUF architecture kvserve loads (the tokenizer class follows from it)
HF_MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text"}


class Tokenizer:
    """Text <-> token ids and chat formatting for one model."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer

    @classmethod
    def load(cls, path: str | None, *, cache_root: str | Path | None = None) -> Tokenizer:
        """Load the tokenizer of a GGUF file (cached after the first build) or HF directory."""
        start = time.perf_counter()
        resolved = resolve_model_path(path)
        cached = _cache_folder(resolved, cache_root)
        if cls.is_quick(resolved, cache_root=cache_root):
            tokenizer, source = FastTokenizer(cached), f"cache {cached}"
        elif cached is not None:
            hf_tokenizer, source = _load_gguf_tokenizer(resolved, cached)
            tokenizer = cls(hf_tokenizer)
        else:
            from transformers import AutoTokenizer
            tokenizer, source = cls(AutoTokenizer.from_pretrained(resolved)), resolved
        logger.info("loaded tokenizer in %.2f s from %s", time.perf_counter() - start, source)
        return tokenizer

    @staticmethod
    def is_quick(path: str | None, *, cache_root: str | Path | None = None) -> bool:
        """True when `load` reads a cached folder with the tokenizers library (no transformers, no build)."""
        cached = _cache_folder(resolve_model_path(path), cache_root)
        return cached is not None and FastTokenizer.readable(cached)

    def preload(self) -> None:
        """Load what the first chat request would otherwise wait for (nothing here)."""

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

    def get_vocab(self) -> dict[str, int]:
        """Every vocabulary string (added tokens included) and its id."""
        return self._tok.get_vocab()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation formatted by the model's chat template."""
        if not self.has_chat_template:
            raise ValueError(
                "This model has no chat template; send a plain prompt (completions) instead of messages."
            )
        ids = self.hf_tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        return list(ids)


def _cache_folder(resolved: str, cache_root: str | Path | None) -> Path | None:
    """Where a GGUF's built tokenizer is cached (None for a HF directory, which ships its own)."""
    return cache_dir_for(resolved, cache_root) / CACHE_TOKENIZER if is_gguf(resolved) else None


def _load_gguf_tokenizer(path: str, target: Path) -> tuple[object, str]:
    from transformers import AutoTokenizer

    if (target / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(target)), f"cache {target}"
        except Exception as exc:
            logger.warning("ignoring unreadable tokenizer cache %s: %s", target, exc)
    hf_tokenizer = _build_gguf_tokenizer(path)
    try:
        _save_atomically(hf_tokenizer, target)
    except OSError as exc:
        logger.warning("could not write tokenizer cache %s: %s", target, exc)
    return hf_tokenizer, f"GGUF (cache written to {target})"


def _build_gguf_tokenizer(path: str):
    """transformers' tokenizer of a GGUF file, as `AutoTokenizer.from_pretrained(gguf_file=...)` builds
    it; its tokenizer class is named from the file's architecture (HF_MODEL_TYPES), where AutoTokenizer
    would first parse the whole file with gguf's reader to build a model config (5-20 s)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    from kvserve.model.gguf_file import GGUFFile

    folder, name = os.path.dirname(path), os.path.basename(path)
    field = GGUFFile(path).fields.get("general.architecture")
    model_type = HF_MODEL_TYPES.get(field.contents() if field is not None else None)
    if model_type is None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer_class = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    return tokenizer_class.from_pretrained(folder, gguf_file=name)


class FastTokenizer(Tokenizer):
    """A saved tokenizer folder read with the `tokenizers` library: encode, decode, the vocabulary and
    the special tokens from tokenizer.json and tokenizer_config.json; transformers' tokenizer of the
    same folder is loaded on first use (`hf_tokenizer`: the chat template, grammars, tool parsing)
    or ahead of it on a thread (`preload`)."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as RustTokenizer

        self._folder = folder
        self._fast = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        self._config = json.loads((folder / "tokenizer_config.json").read_text())
        self._hf = None
        self._hf_lock = threading.Lock()

    @staticmethod
    def readable(folder: Path) -> bool:
        """A folder saved by transformers with the `tokenizers` backend (what _save_atomically writes)."""
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return False
        return (folder / "tokenizer.json").is_file() and config.get("backend") == "tokenizers"

    @property
    def hf_tokenizer(self):
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer
                self._hf = AutoTokenizer.from_pretrained(str(self._folder))
            return self._hf

    def preload(self) -> None:
        threading.Thread(target=lambda: self.hf_tokenizer, name="kvserve-tokenizer", daemon=True).start()

    def _special_id(self, name: str) -> int | None:
        token = self._config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._fast.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def vocab_size(self) -> int:
        return self._fast.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        if self._hf is not None:   # loaded: its template, which a caller may have replaced
            return bool(self._hf.chat_template)
        return (self._folder / "chat_template.jinja").is_file() or bool(self._config.get("chat_template"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._fast.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._fast.id_to_token(ids)
        return [self._fast.id_to_token(i) for i in ids]


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
