"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are validated strictly (no "5" for 5, no true for 1) so a wrong type is a clear 400,
and unknown fields are ignored, as OpenAI-compatible servers usually do. Values are checked
once, by SamplingParams, so the API and the offline LLM agree on what is allowed.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvserve.sampling_params import SamplingParams, StructuredOutputsParams, as_structured_outputs
from kvserve.server.tools import ToolPlan, tool_plan

MAX_N = 128
MAX_SEED = 2**63 - 1 - MAX_N  # torch generators take 64-bit seeds; forks add their index


def random_id(prefix: str) -> str:
    """An id like 'cmpl-3f2a...' for a response."""
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    """stream_options: include a final chunk with usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


def _check_tool_calls(i: int, m: ChatMessage) -> None:
    """An assistant's past calls: each {"id", "type": "function", "function": {"name", "arguments"}}."""
    if m.role != "assistant":
        raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")
    for j, call in enumerate(m.tool_calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}] needs function.name (and function.arguments)")


class JsonSchemaFormat(_Request):
    """response_format.json_schema (OpenAI's): a named JSON schema the output follows."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """response_format: plain text, any JSON object, or a JSON schema (OpenAI's shapes)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema: "
                             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None   # OpenAI's: token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None   # vLLM's
    bad_words: list[str] | None = None           # vLLM's
    priority: int = 0                            # vLLM's: lower runs first under --scheduling-policy priority
    kv_policy: str | None = None   # kvserve extra: KV eviction for this request (docs/EVICTION.md)
    cache_salt: str | None = None  # vLLM's: share prefix-cache blocks only with requests of this salt
    kv_retention: dict[str, Any] | None = None  # kvserve extra: pin the prompt's blocks (priority, ttl_s, max_tokens)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a KV transfer (docs/DISTRIBUTED.md "KV connector")
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object, ...

    def _structured(self) -> StructuredOutputsParams | None:
        """The output's constraint: response_format or vLLM's structured_outputs (not both)."""
        from_format = self.response_format.structured_outputs() if self.response_format is not None else None
        if from_format is not None and self.structured_outputs is not None:
            raise ValueError("give either response_format or structured_outputs, not both")
        return from_format or as_structured_outputs(self.structured_outputs)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams from the request; raises ValueError naming a bad field."""
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, kv_policy=self.kv_policy,
            cache_salt=self.cache_salt, kv_retention=self.kv_retention, structured_outputs=self._structured(),
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            priority=self.priority, kv_transfer_params=self.kv_transfer_params,
            **{k: v for k, v in given.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty: give a string, a list of strings or token ids")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        """SamplingParams for each prompt of this request."""
        if self.suffix:
            raise ValueError("suffix is not supported; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be left out); best-of sampling is not supported")
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:   # the prompt tokens' logprobs come back too
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params


class ContentPart(_Request):
    """One part of a message's content; only text is supported."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant's past calls (OpenAI's shape)
    tool_call_id: str | None = None                  # a tool result: the call it answers

    def as_dict(self) -> dict:
        """The message as the chat template expects it: role, text content, past calls, the call a
        tool result answers."""
        content = self.content
        if isinstance(content, list):
            for i, part in enumerate(content):
                if part.type != "text":
                    raise ValueError(f"message content part of type {part.type!r} is not supported; "
                                     "send text parts only")
                if part.text is None:
                    raise ValueError(f"message content part {i} of type 'text' has no 'text' field: "
                                     "give its text, as in {\"type\": \"text\", \"text\": \"...\"}")
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        """The messages as dicts for the chat template."""
        if not self.messages:
            raise ValueError("messages must hold at least one message")
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise ValueError(f"messages[{i}] has no content: every message needs 'content', "
                                 "a string or a list of text parts (an assistant message may give tool_calls)")
            if m.tool_calls is not None:
                _check_tool_calls(i, m)
        return [m.as_dict() for m in self.messages]

    def tool_plan(self, parser: str | None, auto_enabled: bool) -> ToolPlan:
        """How this request uses tools (ValueError naming what is wrong)."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls, parser, auto_enabled)

    def sampling_params(self, plan: ToolPlan | None = None) -> SamplingParams:
        """SamplingParams for this request; a required or named tool_choice constrains the output."""
        forced = plan.constraint() if plan is not None else None
        if forced is not None and (self.response_format is not None and self.response_format.type != "text"
                                   or self.structured_outputs is not None):
            raise ValueError("a 'required' or named tool_choice constrains the output itself: leave out "
                             "response_format / structured_outputs")
        if forced is not None:
            return dataclasses.replace(self._chat_params(), structured_outputs=forced)
        return self._chat_params()

    def _chat_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a prompt, or messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Any] | None = None

    def conversation(self) -> list[dict] | None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.messages is None:
            return None
        return ChatCompletionRequest(messages=self.messages).conversation()


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses ------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Body of a non-streamed /v1/completions response, or one streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None   # a KV producer's answer (vLLM's)


class TopLogprob(BaseModel):
    """One alternative token of a chat logprobs entry."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    """A generated token with its log-probability and the top alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's reply."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    """One reply."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed /v1/chat/completions response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None   # a KV producer's answer (vLLM's)


class DeltaMessage(BaseModel):
    """The part of a reply a streamed chunk adds."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # whole calls, each with its index

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Body of GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Body of every error response: {"error": {...}}."""

    error: ErrorInfo
