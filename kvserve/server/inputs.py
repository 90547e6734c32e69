"""User input -> token ids, off the engine thread: byte limits, Unicode checks, safe chat rendering.

The server calls these in a worker thread before a request reaches the engine, so a huge prompt
never stalls the running batch. Every problem with the input is a ValueError whose message
starts with the offending parameter (`prompt`, `messages`), which the app answers with a 400.
"""

from __future__ import annotations

import uuid

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.tools import hermes_messages, template_messages, template_reads_tools


def prompt_byte_limit(tokenizer: Tokenizer | None, max_model_len: int) -> int | None:
    """Bytes beyond which a text cannot fit in max_model_len tokens (no token is longer)."""
    if tokenizer is None:
        return None
    longest = max(len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab())
    return longest * max_model_len


def check_text(param: str, text: str, byte_limit: int | None, max_model_len: int) -> None:
    """Refuse text that is not valid Unicode or is too long to ever fit, before tokenizing it."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(f"{param} is not valid Unicode: it holds the lone surrogate {bad!r} at "
                         f"character {exc.start}; send text as valid UTF-8") from None
    if byte_limit is not None and size > byte_limit:
        raise ValueError(f"{param} is {size} bytes; no text over {byte_limit} bytes fits "
                         f"max_model_len={max_model_len} tokens with this tokenizer: shorten it")


def prompt_token_ids(tokenizer: Tokenizer | None, prompt: str | list[int], byte_limit: int | None,
                     max_model_len: int) -> dict:
    """A completions prompt as the engine takes it: {'prompt', 'prompt_token_ids'}."""
    if not isinstance(prompt, str):
        if len(prompt) > max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens but max_model_len is {max_model_len}: "
                             "shorten the prompt")
        return {"prompt_token_ids": prompt}
    if tokenizer is None:
        raise ValueError("prompt must be token ids: this model has no tokenizer")
    check_text("prompt", prompt, byte_limit, max_model_len)
    return {"prompt": prompt, "prompt_token_ids": _encode(tokenizer, prompt)}


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as exc:  # the tokenizer refused the text: the caller's input is at fault
        raise ValueError(f"prompt cannot be tokenized: {exc}") from None


# ---- chat --------------------------------------------------------------------------------


def chat_token_ids(tokenizer: Tokenizer | None, messages: list[dict], add_generation_prompt: bool,
                   byte_limit: int | None, max_model_len: int, special_in_content: bool = False,
                   tools: list[dict] | None = None) -> dict:
    """A conversation formatted by the chat template, as {'prompt_token_ids'}; `tools` (OpenAI's
    function definitions) go to a template that reads them, else into a Hermes system message
    (server/tools.py).

    Unless `special_in_content`, special-token text inside a message (`<|im_end|>`, ...) is
    encoded as plain text, so a user cannot write turns of other roles.
    """
    if tokenizer is None or not tokenizer.has_chat_template:
        raise ValueError("messages need a chat template, which this model does not have: use "
                         "/v1/completions with a plain prompt")
    for i, m in enumerate(messages):
        check_text(f"messages[{i}].content", m["content"] or "", None, max_model_len)
        check_text(f"messages[{i}].name", m.get("name") or "", None, max_model_len)
    native = bool(tools) and template_reads_tools(tokenizer.hf_tokenizer)
    messages = template_messages(messages) if native else hermes_messages(messages, tools or [])
    total = sum(len((m["content"] or "").encode("utf-8")) for m in messages)
    if byte_limit is not None and total > byte_limit:
        raise ValueError(f"messages hold {total} bytes of content; no conversation over {byte_limit} "
                         f"bytes fits max_model_len={max_model_len} tokens with this tokenizer: shorten it")
    specials = [] if special_in_content else _special_texts(tokenizer)
    try:
        return {"prompt_token_ids": _render(tokenizer.hf_tokenizer, messages, add_generation_prompt, specials,
                                            tools if native else None)}
    except ValueError:
        raise
    except Exception as exc:  # template (jinja) and tokenizer errors come from the messages
        raise ValueError(f"messages cannot be formatted with the chat template: {exc}") from None


def _special_texts(tokenizer: Tokenizer) -> list[str]:
    return [t.content for t in tokenizer.hf_tokenizer.added_tokens_decoder.values() if t.special]


def _render(hf, messages: list[dict], add_generation_prompt: bool, specials: list[str],
            tools: list[dict] | None = None) -> list[int]:
    """Token ids of the templated conversation; contents holding `specials` are encoded as text."""
    for m in messages:
        if any(s in (m.get("name") or "") for s in specials):
            raise ValueError("messages: a message name holds special-token text; remove it")
    marked = {i: f"\ue000{uuid.uuid4().hex}\ue001" for i, m in enumerate(messages)
              if any(s in (m["content"] or "") for s in specials)}
    shown = [{**m, "content": marked[i]} if i in marked else m for i, m in enumerate(messages)]
    extra = {"tools": tools} if tools else {}
    text = hf.apply_chat_template(shown, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    ids: list[int] = []
    for i, mark in marked.items():
        before, found, text = text.partition(mark)
        if not found or mark in text or any(other in before for other in marked.values()):
            raise ValueError("messages: this model's chat template does not keep message content as "
                             "it is, so special-token text in it cannot be encoded as plain text; "
                             "remove it (or start the server with --allow-special-tokens-in-content)")
        ids += hf.encode(before, add_special_tokens=False)
        ids += hf.encode(messages[i]["content"], add_special_tokens=False, split_special_tokens=True)
    return ids + hf.encode(text, add_special_tokens=False)
