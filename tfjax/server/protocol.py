"""The OpenAI wire format: request validation (`parse_completion`), error bodies, and reply shapes.

Everything here is plain Python over dicts, no engine and no HTTP: a request is checked field by field
before anything is submitted, and every refusal is an `ApiError` with an HTTP status and an OpenAI-style
`{"error": {"message", "type", "param", "code"}}` body.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from tfjax.server import tools as tooling
from tfjax.server.errors import ApiError, error_body

__all__ = ["ApiError", "error_body", "Params", "parse_completion", "load_json"]

# Fields we accept and ignore: they ask nothing of generation.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Fields we accept only at their "off" value, since we cannot honour anything else.
OFF_VALUES: dict[str, tuple] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False),
}
SAMPLING = ("max_tokens", "max_completion_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "draft",
            "ignore_eos", "stream", "stream_options", "model", "n")
CHAT_ONLY = ("tools", "tool_choice", "chat_template_kwargs")
MAX_N = 128  # OpenAI's bound on choices per request
INT_MAX = 2**31 - 1  # integers the engine takes as int32
# Template variables a request may not set through chat_template_kwargs: the server passes them itself.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})
# Logit processors, logprobs and structured output: checked by `parse_sampling_fields`.
PROCESSORS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs",
              "response_format")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Params:
    """A validated completion request: the prompt (text, ids or chat messages) and how to sample it."""

    chat: bool
    prompt: str | list[int] | list[dict]
    max_tokens: int | None = None  # None: the server's default, within the context
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    draft: bool = True
    ignore_eos: bool = False
    stream: bool = False
    model: str | None = None
    n: int = 1
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage and no choices
    tools: tuple[dict, ...] = ()
    tool_choice: str | None = None  # None, "none", "auto", "required", or the one function's name
    template_kwargs: dict = dataclasses.field(default_factory=dict)  # chat_template_kwargs
    sampling: dict = dataclasses.field(default_factory=dict)  # parse_sampling_fields: LLM.request keywords

    @property
    def parse_tools(self) -> bool:
        """Whether the reply is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def load_json(raw: bytes) -> dict:
    """The request body as a JSON object, or 400 invalid_json: also for NaN/Infinity, nesting deeper than Python's
    recursion limit, integers of more than 4300 digits and strings holding lone surrogates (no UTF-8 exists)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}", "invalid_json")
    _check_strings(body)
    return body


def _check_strings(value: Any) -> None:
    """400 for any key or string that is not valid Unicode text (a lone surrogate such as "\\ud800")."""
    todo = [value]
    while todo:  # a loop, not recursion: the body may be as deep as json.loads allows
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "the request body holds a string with a lone surrogate (an escape such as "
                               "\\ud800 without its pair); send valid Unicode", "invalid_json") from None


def _show(value: Any) -> str:
    """A short rendering of a client's value for an error message (never a deep or long dump)."""
    if isinstance(value, dict | list):
        return f"{'an object' if isinstance(value, dict) else 'a list'} of {len(value)} items"
    shown = json.dumps(value[:80] if isinstance(value, str) else value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _type_error(name: str, want: str, value: Any) -> ApiError:
    return ApiError(400, f"'{name}' must be {want}, got {_show(value)}", "invalid_type", name)


def _number(body: dict, name: str, default, *, integer: bool = False, lo=None, hi=None, lo_open: bool = False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        raise _type_error(name, "an integer" if integer else "a number", value)
    if not integer and not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be finite, got {value}", "invalid_value", name)
    if integer and hi is None:
        hi = INT_MAX
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        span = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
        raise ApiError(400, f"'{name}' must be in {span}, got {value}", "invalid_value", name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or a list of strings", value)
    if len(stops) > 16 or any(not s for s in stops):
        raise ApiError(400, "'stop' takes at most 16 non-empty strings", "invalid_value", "stop")
    return tuple(stops)


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or a list of text parts joined."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":  # a message of tool calls only
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _type_error(f"messages[{i}].content", "a string or a list of text parts", content)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", "missing_required_parameter", "messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise _type_error("messages", "a non-empty list of message objects", messages)
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_show(role)}",
                           "invalid_value", f"messages[{i}].role")
        message = {"role": role, "content": _content(m, i)}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls", "invalid_value",
                               f"messages[{i}].tool_calls")
            message["tool_calls"] = tooling.check_message_calls(m["tool_calls"], i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(400, f"messages[{i}]: a tool message needs 'tool_call_id' (a string), the id of the "
                               "call it answers", "missing_required_parameter", f"messages[{i}].tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "missing_required_parameter", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "a batch of prompts is not supported; send one request per prompt",
                       "unsupported_parameter", "prompt")
    raise _type_error("prompt", "a string or a list of token ids", prompt)


def parse_completion(body: dict, chat: bool, default_temperature: float = 1.0) -> Params:
    """Validate a /v1/chat/completions (chat) or /v1/completions body; every refusal is a 400 ApiError."""
    prompt_field = "messages" if chat else "prompt"
    for name in body:
        if name in IGNORED or name in SAMPLING or name in PROCESSORS or name == prompt_field or (chat and name in CHAT_ONLY):
            continue
        if name in OFF_VALUES:
            if body[name] not in OFF_VALUES[name]:
                raise ApiError(400, f"'{name}' = {_show(body[name])} is not supported by this server",
                               "unsupported_parameter", name)
            continue
        raise ApiError(400, f"unrecognized request argument: '{name}'", "unknown_parameter", name)
    prompt = _messages(body) if chat else _prompt(body)
    max_tokens = _number(body, "max_tokens", None, integer=True, lo=1)
    if body.get("max_completion_tokens") is not None:  # the newer name wins
        max_tokens = _number(body, "max_completion_tokens", None, integer=True, lo=1)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _type_error("stream_options", 'an object like {"include_usage": true}', options)
    if options is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", "invalid_value",
                       "stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    tools = tooling.check_tools(body["tools"]) if body.get("tools") is not None else ()
    tool_choice = tooling.check_tool_choice(body.get("tool_choice"), tools)
    if tool_choice not in (None, "none") and not tools:
        raise ApiError(400, "'tool_choice' needs 'tools'", "invalid_value", "tool_choice")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise _type_error("chat_template_kwargs", 'an object such as {"enable_thinking": false}', kwargs)
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs)):
        raise ApiError(400, f"'chat_template_kwargs' may not set '{reserved[0]}': the request's own fields do",
                       "invalid_value", "chat_template_kwargs")
    return Params(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", default_temperature, lo=0.0, hi=2.0)),
        top_k=_number(body, "top_k", 0, integer=True, lo=0),
        top_p=float(_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)),
        min_p=float(_number(body, "min_p", 0.0, lo=0.0, hi=1.0)),
        seed=_number(body, "seed", None, integer=True, lo=0, hi=2**32 - 1),
        stop=_stop(body),
        draft=_bool(body, "draft", True),
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=stream,
        model=model,
        n=_number(body, "n", 1, integer=True, lo=1, hi=MAX_N),
        include_usage=include_usage,
        tools=tools,
        tool_choice=tool_choice,
        template_kwargs=kwargs,
        sampling=parse_sampling_fields(body, chat),
    )


def parse_sampling_fields(body: dict, chat: bool) -> dict:
    """Penalties, logit_bias, logprobs and response_format as `LLM.request` keywords (400 naming the field).

    Chat asks `logprobs: true` plus `top_logprobs` (0..20); completions ask `logprobs: n` (0..5 alternatives)."""
    out = {"presence_penalty": float(_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)),
           "frequency_penalty": float(_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)),
           "repetition_penalty": float(_number(body, "repetition_penalty", 1.0, lo=0.0, lo_open=True))}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > 300:
            raise _type_error("logit_bias", "an object of at most 300 token ids to numbers in [-100, 100]", bias)
        out["logit_bias"] = {}
        for key, value in bias.items():
            if not str(key).isdigit() or isinstance(value, bool) or not isinstance(value, int | float) or \
                    not -100 <= value <= 100:
                raise ApiError(400, f"logit_bias entry {json.dumps(key)}: {json.dumps(value)} must map a token id to "
                               "a number in [-100, 100]", "invalid_value", "logit_bias")
            out["logit_bias"][int(key)] = float(value)
    if chat:
        out["logprobs"] = _bool(body, "logprobs", False)
        out["top_logprobs"] = _number(body, "top_logprobs", 0, integer=True, lo=0, hi=20)
        if out["top_logprobs"] and not out["logprobs"]:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "invalid_value", "top_logprobs")
    else:
        if body.get("top_logprobs") is not None:
            raise ApiError(400, "completions ask alternatives with 'logprobs': n", "invalid_value", "top_logprobs")
        n = _number(body, "logprobs", None, integer=True, lo=0, hi=5)
        out["logprobs"], out["top_logprobs"] = n is not None, n or 0
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema") or (
                kind == "json_schema" and not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict))):
            raise _type_error("response_format", '{"type": "text"}, {"type": "json_object"} or {"type": '
                              '"json_schema", "json_schema": {"name": ..., "schema": {...}}}', fmt)
        out["response_format"] = fmt
    return out


def _token_entry(tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def token_text(tokenizer, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")


def logprobs_of(chat: bool, tokenizer, ids, lps, tops, text_offset: int = 0) -> dict:
    """OpenAI's logprobs of these tokens: chat `{"content": [...]}`, completions `{"tokens", "token_logprobs",
    "top_logprobs", "text_offset"}` (offsets counted from `text_offset`, the text of the tokens before)."""
    if chat:
        return {"content": [{**_token_entry(tokenizer, t, lp),
                             "top_logprobs": [_token_entry(tokenizer, i, v) for i, v in top]}
                            for t, lp, top in zip(ids, lps, tops, strict=True)]}
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets = [text_offset + sum(len(x) for x in tokens[:k]) for k in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": list(lps), "text_offset": offsets,
            "top_logprobs": [{token_text(tokenizer, i): v for i, v in top} for top in tops]}


def logprobs_body(chat: bool, tokenizer, result, start: int = 0, text_offset: int = 0) -> dict | None:
    """The logprobs of a reply's tokens from `start` on (`logprobs_of`); None when the request asked none."""
    if result.logprobs is None:
        return None
    return logprobs_of(chat, tokenizer, result.token_ids[start:], result.logprobs[start:],
                       result.top_logprobs[start:], text_offset)


def completion_id(chat: bool, request_id: int) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-tfjax-{request_id}"


def chunk(params: Params, rid: str, model: str, created: int, *, index: int = 0, text: str | None = None,
          role: bool = False, tool_calls: list[dict] | None = None, finish_reason: str | None = None,
          extra: dict | None = None, logprobs: dict | None = None) -> dict:
    """One streamed event of one choice: a role opener, a text delta, tool-call deltas, or the finish (whose
    `extra` carries tfjax's token hash and tokens per round)."""
    if params.chat:
        if role:
            delta = {"role": "assistant", "content": ""}
        elif tool_calls:
            delta = {"tool_calls": tool_calls}
        else:
            delta = {"content": text} if text is not None else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    return {**out, **(extra or {})}


def usage(results: list) -> dict:
    """Token counts summed over the choices (the prompt counted once, as OpenAI does)."""
    prompt = results[0].prompt_tokens
    n = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": getattr(results[0], "cached_tokens", 0)}}


def extras(result, draft: bool) -> dict:
    """What tfjax adds to a reply: the token hash, tokens per round, rounds, and whether it drafted."""
    return {"token_sha256": result.token_sha256, "tokens_per_round": round(result.tokens_per_round, 4),
            "rounds": result.rounds, "draft": draft}


def usage_chunk(params: Params, rid: str, model: str, created: int, results: list, draft: bool) -> dict:
    """The stream's last event when stream_options.include_usage asks: no choices, the usage (and choice 0's hash)."""
    obj = "chat.completion.chunk" if params.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(results),
            **extras(results[0], draft)}


def finish_reason(result, calls) -> str:
    return "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason


def choice(params: Params, index: int, text: str, result, draft: bool) -> dict:
    """One whole choice; with tools offered, `<tool_call>` blocks become `tool_calls`."""
    more = extras(result, draft) if params.n > 1 else {}
    if not params.chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": result.finish_reason, **more}
    message: dict = {"role": "assistant", "content": text}
    calls = []
    if params.parse_tools:
        message["content"], calls = tooling.parse(text)
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
    return {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason(result, calls),
            **more}


def reply(params: Params, rid: str, model: str, created: int, choices: list[dict], results: list, draft: bool) -> dict:
    """A whole (non-streamed) reply; the top-level hash is choice 0's."""
    obj = "chat.completion" if params.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage(results), **extras(results[0], draft)}


def now() -> int:
    return int(time.time())
