"""Tool calling without a model: the `<tool_call>` parser (whole and streamed), request checks, prompt rendering."""

from __future__ import annotations

import json
import random

import pytest

from tfjax.server import protocol, tools
from tfjax.server.errors import ApiError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
         '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>')


def test_parse_turns_tagged_json_into_openai_tool_calls_and_keeps_the_rest_as_content():
    content, calls = tools.parse(REPLY)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"}),
                                                                  ("get_weather", {"city": "Oslo"})]
    call = calls[0].openai(index=0)
    assert call["type"] == "function" and call["id"].startswith("call_") and call["index"] == 0
    assert len({c.id for c in calls}) == 2


def test_parse_leaves_text_without_calls_and_broken_or_cut_blocks_as_content():
    assert tools.parse("just text < tool") == ("just text < tool", [])
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "argu'):
        assert tools.parse(text) == (text, []), text
    assert tools.parse('<tool_call>{"name": "f"}</tool_call>')[0] is None  # only a call: no content


@pytest.mark.parametrize("seed", range(5))
def test_streamed_pieces_give_the_same_content_and_calls_as_the_whole_text(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(REPLY)), 12))
    parser = tools.StreamParser()
    items = []
    for a, b in zip([0, *cuts], [*cuts, len(REPLY)], strict=True):
        items += parser.feed(REPLY[a:b])
        assert not any(isinstance(i, str) and "<" in i for i in items), "a tag prefix leaked out as content"
    items += parser.finish()
    content, calls = tools.parse(REPLY)
    assert "".join(i for i in items if isinstance(i, str)).strip() == content.strip()
    assert [(c.name, c.arguments) for c in items if isinstance(c, tools.ToolCall)] == [
        (c.name, c.arguments) for c in calls]


def test_a_held_back_tag_prefix_is_released_when_it_turns_out_to_be_text():
    parser = tools.StreamParser()
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("box>") == ["<toolbox>"]
    assert parser.feed("<tool_c") == [] and parser.finish() == ["<tool_c"]


def chat(**kw) -> protocol.Params:
    return protocol.parse_completion({"messages": [{"role": "user", "content": "Weather in Oslo?"}], **kw}, chat=True)


def test_tool_requests_are_checked_field_by_field():
    assert chat(tools=[WEATHER]).tools == (WEATHER,)
    assert chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_choice \
        == "get_weather"
    bad = [({"tools": {"a": 1}}, "tools"), ({"tools": [{"type": "function", "function": {"name": ""}}]},
                                            "tools[0].function.name"),
           ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
           ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
           ({"chat_template_kwargs": [1]}, "chat_template_kwargs")]
    for extra, param in bad:
        with pytest.raises(ApiError) as e:
            chat(**extra)
        assert e.value.status == 400 and e.value.param == param, (extra, e.value.message)


def test_assistant_tool_calls_and_tool_results_are_accepted_in_the_input():
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 C"}]
    params = protocol.parse_completion({"messages": messages, "tools": [WEATHER]}, chat=True)
    assert params.prompt[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert params.prompt[2]["tool_call_id"] == "call_1"
    rendered, offered = tools.render_args(params.prompt, params.tools, "required", template_knows_tools=False)
    assert offered is None and rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert "must call" in rendered[0]["content"]
    assert '"city": "Oslo"' in rendered[2]["content"] and "rain, 7 C" in rendered[3]["content"]
    rendered, offered = tools.render_args(params.prompt, params.tools, "none", template_knows_tools=True)
    assert offered is None and rendered == params.prompt
    for bad in ({"role": "tool", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}):
        with pytest.raises(ApiError):
            protocol.parse_completion({"messages": [bad]}, chat=True)


def test_choice_regex_spells_exactly_the_calls_tool_choice_allows():
    import re

    clock = {"type": "function", "function": {"name": "now (v2)"}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    tick = '<tool_call>\n{"name": "now (v2)", "arguments": {}}\n</tool_call>'
    assert tools.choice_regex((WEATHER, clock), "auto") is None and tools.choice_regex((WEATHER,), "none") is None
    named = tools.choice_regex((WEATHER, clock), "get_weather")
    assert re.fullmatch(named, call) and not re.fullmatch(named, tick) and not re.fullmatch(named, f"{call}\n{call}")
    assert not re.fullmatch(named, call.replace('"Oslo"', "3")), "arguments follow the tool's schema"
    required = tools.choice_regex((WEATHER, clock), "required")
    for ok in (call, tick, f"{tick}\n{call}\n{call}"):
        assert re.fullmatch(required, ok), ok
    for bad in ("", "Sure. " + call, call.replace("get_weather", "get_time")):
        assert not re.fullmatch(required, bad), bad
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "widget"}}}
    with pytest.raises(ApiError) as e:
        tools.choice_regex((WEATHER, odd), "required")
    assert e.value.param == "tools[1].function.parameters"
