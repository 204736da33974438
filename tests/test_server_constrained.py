"""Constrained replies and streamed logprobs through the official `openai` client: tool_choice "required" and a
named function give parsed tool calls whose arguments follow the tool's schema (streamed and not), "none" gives
none, a constrained tool request drafts exactly, and each streamed chunk carries its own tokens' logprobs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"enum": ["c", "f"]}, "days": {"type": "boolean"}},
                   "required": ["city", "unit", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time."}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
EOS_FIRST = {"2": 100, "0": 100}  # SmolLM2's EOS ids: end as soon as the grammar allows, so "required" makes one call


def _validate(instance, schema) -> None:
    import jsonschema

    jsonschema.validate(instance, schema)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    from tests.helpers import make_tiny_llama_with_tokenizer
    from tests.server_helpers import serving
    from tfjax import api, packaged
    from tfjax.server import create_app

    # server_helpers' tiny model has a context of 256: too short for the tool prompt (230 tokens) plus a call
    folder = make_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny") / "tiny", packaged.ensure_converted("smollm2"))
    llm = api.load(folder, lanes=2, width=4, context=512)
    with serving(create_app(llm, name="tiny", max_tokens=16)) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _calls(client, stream: bool, model: str = "tiny", **kw) -> tuple[list[tuple[str, dict]], str, dict]:
    """([(name, arguments)], finish_reason, extra fields) of one chat request, streamed or not."""
    body = dict(model=model, messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=150, **kw)
    if not stream:
        reply = client.chat.completions.create(**body)
        calls = reply.choices[0].message.tool_calls or []
        return ([(c.function.name, json.loads(c.function.arguments)) for c in calls], reply.choices[0].finish_reason,
                reply.model_extra)
    calls, finish, extra = [], None, {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                assert call.index == len(calls) and call.id.startswith("call_")
                calls.append((call.function.name, json.loads(call.function.arguments)))
            if c.finish_reason:
                finish, extra = c.finish_reason, chunk.model_extra
    return calls, finish, extra


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_named_and_required_give_calls_that_follow_the_tool_schema(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, finish, _ = _calls(client, stream, tool_choice=named, temperature=0.9, seed=4)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_weather", (calls, finish)
    _validate(calls[0][1], WEATHER["function"]["parameters"])
    calls, finish, _ = _calls(client, stream, tool_choice="required", temperature=0.9, seed=7,
                              logit_bias=EOS_FIRST)
    assert finish == "tool_calls" and len(calls) == 1, (calls, finish)
    name, args = calls[0]
    if name == "get_weather":
        _validate(args, WEATHER["function"]["parameters"])
    else:
        assert (name, args) == ("now", {})


def test_tool_choice_none_keeps_tools_out_of_the_reply(client):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="none",
                                           max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert choice.message.content is not None


def test_a_constrained_tool_request_drafts_exactly(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for params in ({"temperature": 0}, {"temperature": 1.0, "seed": 9}):
        _, _, drafted = _calls(client, False, tool_choice=named, **params)
        _, _, plain = _calls(client, False, tool_choice=named, extra_body={"draft": False}, **params)
        assert drafted["token_sha256"] == plain["token_sha256"] and not plain["draft"]


def test_tool_choice_with_response_format_is_a_400_naming_the_field(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"


def test_streamed_logprobs_come_with_each_chunk_and_equal_the_whole_reply(client):
    chat = dict(model="tiny", messages=MESSAGES, max_tokens=14, temperature=0.8, seed=2, logprobs=True,
                top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat).choices[0]
    want = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in whole.logprobs.content]
    got, text, carrying = [], "", 0
    for chunk in client.chat.completions.create(**chat, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                carrying += bool(c.delta.content)
                got += [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                        for e in c.logprobs.content]
    assert got == want and text == whole.message.content
    assert carrying > 1, "logprobs should come with the text chunks, not only with the finish"
    plain = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2,
                 extra_body={"ignore_eos": True})
    whole = client.completions.create(**plain).choices[0].logprobs
    tokens, lps, offsets, tops = [], [], [], []
    for chunk in client.completions.create(**plain, stream=True):
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            tokens += lp.tokens
            lps += lp.token_logprobs
            offsets += lp.text_offset
            tops += lp.top_logprobs
    assert (tokens, lps, offsets, tops) == (whole.tokens, whole.token_logprobs, whole.text_offset, whole.top_logprobs)


# SmolLM2 ids: '{"' opens an object and its key (and closes a string), ':' follows the key, '}' closes, then EOS
NESTING = {"39428": 40, "42": 30, "109": 20, **EOS_FIRST}


def _depth(value) -> int:
    return 1 + max(map(_depth, value.values() if isinstance(value, dict) else value), default=0) \
        if isinstance(value, dict | list) else 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_object_reply_nests_to_max_depth_and_parses_with_json_loads(client, stream):
    from tfjax.json_pushdown import MAX_DEPTH, accepts

    body = dict(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, logit_bias=NESTING,
                response_format={"type": "json_object"})
    if stream:
        chunks = list(client.chat.completions.create(**body, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    else:
        reply = client.chat.completions.create(**body)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop", text
    value = json.loads(text)
    assert isinstance(value, dict) and accepts(text.encode())
    assert _depth(value) == MAX_DEPTH, text  # the bias opens objects until the grammar forbids one more


def test_json_object_accepts_nested_objects_and_arrays_to_its_documented_depth():
    from tfjax.json_pushdown import MAX_DEPTH, accepts

    for ok in ({"a": {"b": 1, "c": "x"}, "d": [True, 2.5, None, "y"], "e": {}}, {"list": [], "o": {"k": "v"}}, {},
               {"a": {"b": {"c": {"d": {"e": [[{"f": [1, {"g": None}]}]]}}}}}, {"a": [{"b": 1}], "c": [[1]]}):
        assert accepts(json.dumps(ok).encode()), ok
    deepest = {"a": 1}
    for i in range(MAX_DEPTH - 2):  # with {"a": 1} and the top object: MAX_DEPTH containers
        deepest = {"k": deepest} if i % 2 else [deepest]
    deepest = {"top": deepest}
    assert accepts(json.dumps(deepest).encode())
    assert not accepts(json.dumps({"top": [deepest["top"]]}).encode()), "one container past MAX_DEPTH"


@pytest.mark.slow  # SmolLM2 (49k vocabulary, a real model): a minute or more per request on 2 cores
def test_smollm2_calls_the_named_tool_with_arguments_that_validate():
    from openai import OpenAI

    from tests.server_helpers import serving
    from tfjax import api, packaged
    from tfjax.server import create_app

    llm = api.load(packaged.ensure_converted("smollm2"), lanes=2, width=6, context=1024, copy_match=3)
    with serving(create_app(llm, name="smollm2")) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for stream in (False, True):
            calls, finish, extra = _calls(client, stream, "smollm2", tool_choice=named, temperature=0)
            assert finish == "tool_calls" and [n for n, _ in calls] == ["get_weather"], (calls, finish)
            _validate(calls[0][1], WEATHER["function"]["parameters"])
        _, _, plain = _calls(client, False, "smollm2", tool_choice=named, temperature=0,
                             extra_body={"draft": False})
        assert plain["token_sha256"] == extra["token_sha256"]
