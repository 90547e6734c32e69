"""Sampling and beam-search parameters, with vLLM's fields, defaults and ranges."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, fields

_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2  # vLLM's floor for a non-zero temperature: smaller ones overflow
MAX_LOGPROBS = 20
MAX_CONSTRAINT_BYTES = 64 * 1024   # a structured-output schema, regex or grammar
# The sampler computes in float32: a value it turns into 0 or inf makes NaN logits.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def _check(name: str, value: object, ok: bool, allowed: str) -> None:
    """Raise ValueError naming the field, its value and the allowed range unless ok."""
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    ok = _is_int(value) and value >= lo and (hi is None or value <= hi)
    _check(name, value, ok, allowed)


def _check_float(name: str, value: object, ok_range, allowed: str) -> None:
    _check(name, value, _is_number(value) and ok_range(value), allowed)


def _check_temperature(value: object) -> None:
    _check_float("temperature", value, lambda t: 0 <= t <= FLOAT32_MAX,
                 f"a number in [0, {FLOAT32_MAX:.4g}] (float32)")


@dataclass(frozen=True)
class KVRetention:
    """Keep the request's prompt blocks in the prefix cache: evicted last (lowest priority first)
    until `ttl_s` seconds after they are cached (None: until the pool needs them); `max_tokens`
    pins only that many leading prompt tokens (None: the whole prompt)."""

    priority: int = 50
    ttl_s: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_int("kv_retention.priority", self.priority, 0, 100)
        if self.ttl_s is not None:
            _check_float("kv_retention.ttl_s", self.ttl_s, lambda t: 0 < t < math.inf,
                         "a number of seconds > 0 (or null for no expiry)")
            object.__setattr__(self, "ttl_s", float(self.ttl_s))
        if self.max_tokens is not None:
            _check_int("kv_retention.max_tokens", self.max_tokens, 1)


def _from_fields(cls, name: str, value: object, wants: str = ""):
    """A `cls` from None, a `cls` or a dict of its fields; ValueError naming `name` and what is wrong."""
    if value is None or isinstance(value, cls):
        return value
    names = [f.name for f in fields(cls)]
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object with {wants}{names}, got {value!r}")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; use {names}")
    return cls(**value)


def as_retention(value: object) -> KVRetention | None:
    """A KVRetention from None, a KVRetention or a dict of its fields (ValueError naming what is wrong)."""
    return _from_fields(KVRetention, "kv_retention", value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the tokens a request may generate (vLLM's StructuredOutputsParams): exactly one
    of `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON object), `regex`,
    `choice` (one of these strings), `grammar` (an EBNF grammar, GBNF-style: root ::= ...) or
    `structural_tag` (xgrammar's structural tag, as JSON text). `disable_any_whitespace`: JSON with no
    whitespace but one space after each ',' and ':'. A schema's objects take only the keys it names unless it says
    `additionalProperties` (OpenAI's strict mode)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {list(self.KINDS)}, got "
                             f"{given or 'none'}")
        if self.choice is not None:
            choice = list(self.choice)
            _check("structured_outputs.choice", self.choice,
                   bool(choice) and all(isinstance(c, str) and c for c in choice), "a list of non-empty strings")
            object.__setattr__(self, "choice", choice)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check(f"structured_outputs.{name}", value, value is None or (isinstance(value, str) and value),
                   "a non-empty string")
        _check("structured_outputs.json", self.json, self.json is None or isinstance(self.json, (str, dict)),
               "a JSON schema (an object, or its JSON text)")
        size = len(self.text.encode("utf-8", "replace"))
        if size > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"structured_outputs.{self.kind} is {size} bytes; a constraint may be at most "
                             f"{MAX_CONSTRAINT_BYTES} bytes (compiling it would hold up other requests)")

    @property
    def text(self) -> str:
        """The constraint as text (a schema as JSON), what its size is measured on."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            return json.dumps(value)
        if isinstance(value, list):
            return "\n".join(value)
        return value if isinstance(value, str) else ""

    @property
    def kind(self) -> str:
        """Which constraint this is (one of KINDS)."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


def as_structured_outputs(value: object) -> StructuredOutputsParams | None:
    """StructuredOutputsParams from None, itself or a dict of its fields (ValueError naming what is wrong)."""
    return _from_fields(StructuredOutputsParams, "structured_outputs", value, "some of ")


class RequestOutputKind(enum.IntEnum):
    """What the engine's outputs for a request hold (vLLM's names)."""

    CUMULATIVE = 0   # at every step: everything generated so far
    DELTA = 1        # at every step: only what is new since the last output
    FINAL_ONLY = 2   # once, when the request finishes (LLM.generate)


def _output_kind(kind) -> RequestOutputKind:
    if kind is None:
        return RequestOutputKind.CUMULATIVE
    try:
        return RequestOutputKind(kind)
    except ValueError:
        raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]} (or 0-2), "
                         f"got {kind!r}") from None


@dataclass
class SamplingParams:
    """How to pick tokens for one request; fields, defaults and meaning follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    kv_policy: str | None = None   # KV eviction for this request (kv/policies.py); None = the engine's
    cache_salt: str | None = None  # shares prefix-cache blocks only with requests of the same salt
    kv_retention: KVRetention | dict | None = None  # pin the prompt's blocks in the prefix cache
    output_kind: RequestOutputKind | int | None = None  # what each output holds; None = CUMULATIVE
    structured_outputs: StructuredOutputsParams | dict | None = None  # a grammar the output follows
    logit_bias: dict[int, float] | None = None      # OpenAI's: token id -> bias added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None      # vLLM's: only these tokens may be drawn
    bad_words: list[str] | None = None              # vLLM's: words the output never completes
    priority: int = 0   # vLLM's request priority (an argument of its generate): lower runs first
                        # under scheduling_policy='priority'
    kv_transfer_params: dict | None = None   # vLLM's: {"do_remote_decode": true} on a producer; a producer's
                                             # answer ({"do_remote_prefill": true, ...}) on a consumer

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self._validate_sampling()
        self._validate_lengths()
        self._validate_penalties()
        self._validate_logprobs()
        check_cache_salt(self.cache_salt)
        self.output_kind = _output_kind(self.output_kind)
        self.kv_retention = as_retention(self.kv_retention)
        self.structured_outputs = as_structured_outputs(self.structured_outputs)
        self._validate_token_filters()
        _check("priority", self.priority, _is_int(self.priority), "an integer")
        _check("kv_transfer_params", self.kv_transfer_params,
               self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict), "a JSON object")
        if self.kv_policy is not None:
            from kvserve.kv.policies import parse_policy
            parse_policy(self.kv_policy)

    def _validate_sampling(self) -> None:
        _check_int("n", self.n, 1)
        _check_temperature(self.temperature)
        if 0 < self.temperature < _MIN_TEMPERATURE:  # as vLLM: clamp, do not fail
            self.temperature = _MIN_TEMPERATURE
        _check_float("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1]")
        _check("top_k", self.top_k, _is_int(self.top_k) and self.top_k >= -1,
               "-1 or 0 (disabled) or an integer >= 1")
        _check_float("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1]")
        _check("seed", self.seed, self.seed is None or _is_int(self.seed), "None or an integer")

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        hi = self.max_tokens
        allowed = "an integer >= 0" if hi is None else f"an integer in [0, max_tokens={hi}]"
        ok = _is_int(self.min_tokens) and self.min_tokens >= 0 and (hi is None or self.min_tokens <= hi)
        _check("min_tokens", self.min_tokens, ok, allowed)

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty,
                     lambda v: FLOAT32_TINY <= v <= FLOAT32_MAX,
                     f"a number in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (> 0 in float32)")

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)

    def _validate_token_filters(self) -> None:
        if self.logit_bias is not None:
            _check("logit_bias", self.logit_bias, isinstance(self.logit_bias, dict), "an object of token id -> bias")
            bias = {}
            for tok, value in self.logit_bias.items():
                tid = int(tok) if isinstance(tok, str) and tok.strip().isdigit() else tok
                _check("logit_bias key", tok, _is_int(tid) and tid >= 0, "a token id (an integer >= 0)")
                _check_float(f"logit_bias[{tok}]", value, lambda v: -100 <= v <= 100, "in [-100, 100]")
                bias[tid] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            _check("allowed_token_ids", self.allowed_token_ids, bool(ids) and all(_is_int(t) and t >= 0 for t in ids),
                   "a non-empty list of token ids")
            self.allowed_token_ids = ids
        if self.bad_words is not None:
            words = list(self.bad_words)
            _check("bad_words", self.bad_words, all(isinstance(w, str) and w.strip() for w in words),
                   "a list of non-empty strings")
            self.bad_words = words or None

    @property
    def greedy(self) -> bool:
        """True when temperature is (near) zero: always take the argmax."""
        return self.temperature < _SAMPLING_EPS


def check_cache_salt(salt: object) -> None:
    """Raise ValueError unless `salt` is None or a non-empty string."""
    _check("cache_salt", salt, salt is None or (isinstance(salt, str) and len(salt) > 0),
           "a non-empty string (or left out for no salt)")


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    """Turn None / one string / a list into a list of non-empty stop strings."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        _check("stop", s, isinstance(s, str) and len(s) > 0, "a non-empty string")
    return stops


def _normalise_stop_token_ids(ids: list[int] | None) -> list[int]:
    """Turn None / a list into a list of non-negative token ids."""
    if ids is None:
        return []
    ids = list(ids)
    for t in ids:
        _check("stop_token_ids", t, _is_int(t) and t >= 0, "a list of integers >= 0")
    return ids


@dataclass
class BeamSearchParams:
    """Parameters of beam search (vLLM's LLM.beam_search)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_temperature(self.temperature)
        _check_float("length_penalty", self.length_penalty, math.isfinite, "a finite number")


def remote_prefill(params: SamplingParams) -> bool:
    """True when the request's KV is to be received from a producer (its kv_transfer_params)."""
    return bool((params.kv_transfer_params or {}).get("do_remote_prefill"))


def remote_decode(params: SamplingParams) -> bool:
    """True when the request's prompt KV is to be saved for a consumer (its kv_transfer_params)."""
    return bool((params.kv_transfer_params or {}).get("do_remote_decode"))
