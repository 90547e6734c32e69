"""Tool calling pieces against hand-written examples: the Hermes and JSON parsers, the streamed
reader (fed a character at a time it gives what the whole-text parser gives, holding back what may
begin a call), the plan's grammar for 'required' / a named function, the request checks, and the
prompt a template without tool support is given."""

from __future__ import annotations

import json

import pytest

from kvserve.server import inputs
from kvserve.server.tools import ToolPlan, hermes_messages, parse_hermes, parse_json, tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_parser_takes_each_block_and_keeps_the_text_around_them():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.')
    content, calls = parse_hermes(text)
    assert content == "Let me check.  Done."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(broken) == (broken, [])   # a block that does not parse stays content


def test_json_parser_takes_one_object_or_an_array_with_arguments_or_parameters():
    assert _calls(parse_json('{"name": "get_time", "parameters": {}}')[1]) == [("get_time", {})]
    content, calls = parse_json('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time"}]')
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert parse_json('{"city": "Oslo"}') == ('{"city": "Oslo"}', [])   # no name: not a call
    assert parse_json("Sunny.") == ("Sunny.", [])


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Sure <tool_call>{"name": "get_time", "arguments": {}}</tool_call> and <tool_ca'),
    ("hermes", "Just text, with a < sign and <tool but no call."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'),
    ("json", '  [{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    ("json", "Plain words {not a call}"),
])
def test_streamed_reading_fed_one_character_at_a_time_equals_the_whole_text(parser, text):
    plan = tool_plan([WEATHER, TIME], "auto", None, parser, True)
    stream, content, calls = plan.stream(), "", []
    for ch in text:
        piece, done = stream.feed(ch)
        content, calls = content + piece, calls + done
        assert "<tool_call>" not in content   # a call's text is never sent as content
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    want_content, want_calls = plan.parse(text)
    assert _calls(calls) == _calls(want_calls)
    assert content.strip() == (want_content or "").strip()


def test_required_and_named_choices_are_grammars_whose_output_parses():
    required = tool_plan([WEATHER, TIME], "required", False, None, False)
    schema = required.constraint().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert _calls(required.parse('[{"name": "get_weather", "parameters": {"city": "Lima"}}]')[1]) == [
        ("get_weather", {"city": "Lima"})]
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, None, False)
    assert named.constraint().json == WEATHER["function"]["parameters"]
    assert _calls(named.parse('{"city": "Lima"}')[1]) == [("get_weather", {"city": "Lima"})]
    assert named.parse('{"city": "Li') == ('{"city": "Li', [])   # cut short by max_tokens: no call
    assert tool_plan(None, None, None, None, False).choice == "none"


@pytest.mark.parametrize("tools,choice,why", [
    ([WEATHER], "auto", "--enable-auto-tool-choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    (None, "required", "needs tools"),
    ([WEATHER, WEATHER], "required", "name each function once"),
    ([{"type": "function", "function": {}}], "required", "needs a non-empty 'name'"),
    ([WEATHER], "sometimes", "tool_choice must be"),
])
def test_bad_tool_requests_say_what_is_wrong(tools, choice, why):
    with pytest.raises(ValueError, match=why):
        tool_plan(tools, choice, None, None, False)


def test_a_template_without_tools_gets_them_in_a_hermes_system_message(llm):
    """SmolLM2's template does not read `tools`: the conversation is given a system message listing
    them, past calls as <tool_call> text and results as <tool_response> text."""
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"}]
    shown = hermes_messages(history, [WEATHER])
    assert shown[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert json.dumps(WEATHER) in shown[0]["content"]
    assert shown[2] == {"role": "assistant", "content":
                        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert shown[3] == {"role": "tool", "content": "<tool_response>\n18 C, cloudy\n</tool_response>"}
    tok = llm.engine.tokenizer
    got = inputs.chat_token_ids(tok, history, True, None, 2048, tools=[WEATHER])["prompt_token_ids"]
    assert got == tok.apply_chat_template(shown, add_generation_prompt=True)


def test_plan_offers_no_tools_under_tool_choice_none():
    assert ToolPlan([WEATHER], "none").offered == []
    assert ToolPlan([WEATHER], "required").offered == [WEATHER]
