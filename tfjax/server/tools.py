"""Tool calling: tool specs checked, tools put into the prompt, and Qwen/Hermes-style output parsed back.

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; `StreamParser` turns text pieces
into content text and `ToolCall`s as they arrive (holding back a tail that may begin `<tool_call>`), and
`parse` runs the same parser over a whole reply, so a streamed reply and a whole one always agree.
`tool_choice` "required" or a named function is enforced, not only asked: `choice_regex` spells the calls the
reply must be (the tags in the format the prompt shows, each function's name, its arguments following its
`parameters` schema), and the grammar machinery masks every verify row with it, so such a request still drafts.
Templates that know nothing of tools (no `tools` in their source) get the tool list and the call format as a
system message of ours, and earlier calls and results as text in the same format.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from tfjax import grammar
from tfjax.server.errors import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(body: str) -> ToolCall | None:
    """The call in one `<tool_call>` block, or None when it is not a JSON object with a name."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StreamParser:
    """Text pieces in, content text and ToolCalls out; what was given out is final."""

    def __init__(self):
        self.buf = ""
        self.inside = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buf += text
        out: list[str | ToolCall] = []
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return out
                body, self.buf, self.inside = self.buf[:end], self.buf[end + len(CLOSE) :], False
                call = _call(body)
                out.append(call if call is not None else OPEN + body + CLOSE)  # not a call: the text stays text
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self.buf[:start])
                self.buf, self.inside = self.buf[start + len(OPEN) :], True
                continue
            keep = _partial_tail(self.buf, OPEN)
            if len(self.buf) > keep:
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
            return out

    def finish(self) -> list[str | ToolCall]:
        """What is held back at the end: an unclosed block (a reply cut by max_tokens) stays text."""
        rest = (OPEN if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return [rest] if rest else []


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply; content is None when the reply is only calls and whitespace."""
    parser = StreamParser()
    items = parser.feed(text) + parser.finish()
    calls = [i for i in items if isinstance(i, ToolCall)]
    content = "".join(i for i in items if isinstance(i, str))
    return (None if calls and not content.strip() else content), calls


# --- requests -----------------------------------------------------------------------------------------------
def check_tools(value: Any) -> tuple[dict, ...]:
    """The request's `tools`: function specs with a name and optional description and JSON-schema parameters."""
    if not isinstance(value, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects",
                       "invalid_type", "tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           "invalid_type", where)
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"'{where}.function.name' must be a non-empty string", "invalid_value",
                           f"{where}.function.name")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ApiError(400, f"'{where}.function.description' must be a string", "invalid_type",
                           f"{where}.function.description")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ApiError(400, f"'{where}.function.parameters' must be a JSON schema object", "invalid_type",
                           f"{where}.function.parameters")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if fn.get(k) is not None}})
    return tuple(out)


def check_tool_choice(value: Any, tools: tuple[dict, ...]) -> str | None:
    """None/"none"/"auto"/"required", or the name of the one function the request names; checked against tools."""
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise ApiError(400, "'tool_choice' = \"required\" needs 'tools'", "invalid_value", "tool_choice")
        return value
    if (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        name = value["function"]["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"'tool_choice' names the function {json.dumps(name)}, which is not in 'tools'",
                           "invalid_value", "tool_choice")
        return name
    raise ApiError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "invalid_value", "tool_choice")


def check_message_calls(value: Any, i: int) -> list[dict]:
    """An assistant message's `tool_calls`, with arguments as objects (what chat templates expect)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise ApiError(400, f"'{where}' must be a list of tool calls", "invalid_type", where)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"'{where}[{j}]' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                           f"\"arguments\"}}}}", "invalid_type", f"{where}[{j}]")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                raise ApiError(400, f"'{where}[{j}].function.arguments' is not valid JSON", "invalid_value",
                               f"{where}[{j}].function.arguments") from None
        if not isinstance(args, dict):
            raise ApiError(400, f"'{where}[{j}].function.arguments' must be a JSON object", "invalid_value",
                           f"{where}[{j}].function.arguments")
        out.append({"id": call.get("id") if isinstance(call.get("id"), str) else new_call_id(), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _literal(text: str) -> str:
    """`text` as a regex in outlines-core's (Rust) syntax: its meta characters escaped, nothing else."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in text)


def _call_regex(tool: dict, i: int) -> str:
    """One call of `tool` as the model writes it: tags on their own lines, then {"name": ..., "arguments": {...}}."""
    fn = tool["function"]
    params = fn.get("parameters")
    try:  # no parameters: OpenAI's empty parameter list
        args = grammar.schema_regex(params, f"tools[{i}].function.parameters") if params else r"\{\}"
    except ValueError as e:
        raise ApiError(400, str(e), "invalid_value", f"tools[{i}].function.parameters") from None
    name = _literal(json.dumps(fn["name"], ensure_ascii=False))
    return rf'{_literal(OPEN)}\n\{{"name": {name}, "arguments": {args}\}}\n{_literal(CLOSE)}'


def choice_regex(tools: tuple[dict, ...], choice: str | None) -> str | None:
    """The regex the whole reply must match for `tool_choice` "required" (one or more calls of any offered tool,
    a newline apart) or a function's name (exactly one call of it); None when the reply is free."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        call = "|".join(f"({_call_regex(t, i)})" for i, t in enumerate(tools))
        return rf"({call})(\n({call}))*"
    (i, tool), = [(i, t) for i, t in enumerate(tools) if t["function"]["name"] == choice]
    return _call_regex(tool, i)


# --- prompts ------------------------------------------------------------------------------------------------
def _system_text(tools: tuple[dict, ...]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions. Their signatures, one JSON object per line, are inside <tools></tools>:\n"
            f"<tools>\n{lines}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments inside tags, like\n"
            f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}')


def _choice_text(choice: str | None) -> str:
    if choice == "required":
        return "You must call at least one of the functions."
    if choice not in (None, "auto", "none"):
        return f"You must call the function {choice}."
    return ""


def _add_system(messages: list[dict], text: str) -> list[dict]:
    if not text:
        return messages
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}".lstrip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _as_text(messages: list[dict]) -> list[dict]:
    """Calls and results as the tagged text the model writes, for a template that knows nothing of tools."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n{CLOSE}"  # noqa: E501
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{m['content']}\n{calls}".lstrip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append(m)
    return out


def render_args(messages: list[dict], tools: tuple[dict, ...], choice: str | None,
                template_knows_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to hand to the chat template: tool_choice "none" drops the tools from the prompt."""
    offered = tools if tools and choice != "none" else ()
    if template_knows_tools:
        return _add_system(messages, _choice_text(choice) if offered else ""), (list(offered) or None)
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not offered and not has_history:
        return messages, None
    text = f"{_system_text(offered)}\n{_choice_text(choice)}".strip() if offered else ""
    return _add_system(_as_text(messages), text), None
