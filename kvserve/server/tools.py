"""Tool calling on /v1/chat/completions, in OpenAI's shapes.

- The tool definitions reach the model through its chat template (`tools=`, as transformers renders
  it) when the template reads them; otherwise a system message lists them in the Hermes format
  (`<tools>` JSON signatures, calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`),
  and past calls and tool results in the history are written in the same format.
- `tool_choice`: "none" (no tools offered), "auto" (the model decides; its output is parsed by the
  server's `--tool-call-parser`, and needs `--enable-auto-tool-choice`), "required" (at least one
  call) or a named function; the last two are enforced with a JSON-schema grammar, so the output
  always parses (as vLLM does: a JSON array of {"name", "parameters"} objects, or the named
  function's arguments object).
- Parsers (`--tool-call-parser`): `hermes` (`<tool_call>` blocks, text around them is content) and
  `json` (the whole output is one call object or an array of them, "arguments" or "parameters").
  Streaming holds back text that may begin a call and sends each call as one delta once it is
  complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "json")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_SYSTEM = (
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass
class ToolCall:
    """One parsed call: a function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def check_tools(tools: list | None) -> list[dict]:
    """The request's tools as {"type": "function", "function": {name, description, parameters}}."""
    out = []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function needs a non-empty 'name'")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tools name each function once, got {names}")
    return out


@dataclass
class ToolPlan:
    """How one chat request uses tools: what the prompt offers, what constrains the output and how
    the output is read back."""

    tools: list[dict]
    choice: str                       # none | auto | required | named
    named: str | None = None          # the function a named tool_choice forces
    parser: str | None = None         # auto: the server's --tool-call-parser
    parallel: bool = True

    @property
    def offered(self) -> list[dict]:
        """The tools the prompt shows (none under tool_choice 'none')."""
        return [] if self.choice == "none" else self.tools

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes the output parse: required and named choices."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self._function(self.named)["parameters"])
        if self.choice == "required":
            items = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                                 "parameters": t["function"]["parameters"]},
                                "required": ["name", "parameters"]} for t in self.tools]}
            schema = {"type": "array", "minItems": 1, "items": items}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def _function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; an output cut short (max_tokens) before its call
        is whole stays content."""
        if self.choice == "auto":
            return PARSERS[self.parser](text)
        if self.choice == "none":
            return text, []
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if self.choice == "named":
            return None, [ToolCall(self.named, json.dumps(value, ensure_ascii=False))]
        return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]

    def stream(self) -> ToolStream:
        return ToolStream(self)


def tool_plan(tools: list | None, tool_choice: Any, parallel: bool | None, parser: str | None,
              auto_enabled: bool) -> ToolPlan:
    """The request's plan, or ValueError naming what is wrong (and the server flag that is missing)."""
    checked = check_tools(tools)
    choice, named = _choice(tool_choice, bool(checked))
    if choice != "none" and not checked:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if named is not None and named not in [t["function"]["name"] for t in checked]:
        raise ValueError(f"tool_choice names function {named!r}, which is not among the tools")
    if choice == "auto" and not (auto_enabled and parser):
        raise ValueError("tool_choice 'auto' needs the server started with --enable-auto-tool-choice and "
                         f"--tool-call-parser ({' | '.join(TOOL_CALL_PARSERS)}); use tool_choice 'required' "
                         "or a named function, which need neither")
    return ToolPlan(checked, choice, named, parser, parallel is not False)


def _choice(tool_choice: Any, has_tools: bool) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return "named", name
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}")


# ---- the prompt ---------------------------------------------------------------------------------


def template_reads_tools(hf_tokenizer) -> bool:
    """True when the model's chat template renders a `tools` argument."""
    template = hf_tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return bool(template) and re.search(r"\btools\b", template) is not None


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation for a template that does not read tools: the tools in a system message
    (joined to the first system message if there is one), past calls and results as Hermes text."""
    out = [_hermes_message(m) for m in messages]
    if tools:
        listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _hermes_message(m: dict) -> dict:
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = "\n".join(f"{OPEN}\n{json.dumps(_call_dict(c), ensure_ascii=False)}\n{CLOSE}" for c in m["tool_calls"])
        text = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
        return {"role": "assistant", "content": text}
    if m["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
    return {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}


def _call_dict(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass   # shown as the text it is
    return {"name": fn.get("name"), "arguments": args}


def template_messages(messages: list[dict]) -> list[dict]:
    """The conversation for a template that reads tools: each past call's arguments as an object
    (transformers' templates take them so; OpenAI sends JSON text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _call_dict(c)["arguments"]}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


# ---- reading the output -------------------------------------------------------------------------


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """`<tool_call>{json}</tool_call>` blocks as calls, the rest as content (a block that does not
    parse stays content)."""
    calls, kept, pos = [], [], 0
    for m in re.finditer(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), text, re.S):
        call = _call_of(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def parse_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output as one call object or an array of them; anything else is content."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    items = value if isinstance(value, list) else [value]
    calls = [_call_from(v) for v in items]
    if not items or any(c is None for c in calls):
        return text, []
    return None, calls


def _call_of(body: str) -> ToolCall | None:
    try:
        return _call_from(json.loads(body))
    except json.JSONDecodeError:
        return None


def _call_from(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


PARSERS = {"hermes": parse_hermes, "json": parse_json}


class ToolStream:
    """A streamed output turned into content deltas and whole calls: `feed` each text delta, `finish`
    at the end. Text that may begin a call is held back until it is known."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.buffer = ""
        self.sent_calls = 0
        self.held = plan.choice in ("named", "required")   # the whole output is a call
        self.passthrough = plan.choice == "none"

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed now)."""
        if self.passthrough:
            return text, []
        self.buffer += text
        if self.held:
            return "", []
        if self.plan.parser == "json":
            return self._feed_json()
        return self._feed_hermes()

    def _feed_json(self) -> tuple[str, list[ToolCall]]:
        stripped = self.buffer.lstrip()
        if not stripped:
            return "", []
        if stripped[0] in "{[":
            self.held = True     # a call, read whole at the end
            return "", []
        self.passthrough = True
        out, self.buffer = self.buffer, ""
        return out, []

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, calls
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                return content, calls
            body = self.buffer[start + len(OPEN):end]
            call = _call_of(body)
            segment = self.buffer[:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            if call is None:
                content += segment
            else:
                content += segment[:start]
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: held text as content, or the calls it holds."""
        rest, self.buffer = self.buffer, ""
        if self.passthrough or not rest:
            return rest, []
        if self.held:
            content, calls = self.plan.parse(rest)
            return content or "", calls
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
