"""Tool calls in the model's text: the format, a one-shot parser and a streaming parser.

Format (Hermes/Qwen style). The model answers a call as

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

one block per call, optionally with whitespace around the JSON and text before or
between blocks. `function.arguments` in the API is the *raw* JSON text of the
"arguments" value exactly as the model wrote it (a JSON string value is unquoted),
so streamed fragments always concatenate to the non-streaming result.

A block whose JSON does not parse stays in `content` (non-streaming). When streaming,
a block is only announced once its "name" is complete; a block that never yields a
name is released as content when it closes. A block cut off by max_tokens keeps
what was streamed (finish_reason is then "length").

tool_choice: "auto" parses; "none" neither renders tools into the prompt nor parses;
"required" and a named function also constrain decoding (see constrained.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=make_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def top_level_spans(body: str) -> dict[str, tuple[int, int | None]]:
    """Spans of the values of a (possibly partial) JSON object's top-level keys.

    Returns key -> (start, end) with whitespace trimmed; end is None while the
    value is still open. Only scans structure, so it works on a prefix.
    """
    spans: dict[str, tuple[int, int | None]] = {}
    depth, in_str, esc = 0, False, False
    str_start, last_key, key, val_start = -1, "", "", -1
    for i, c in enumerate(body):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and val_start < 0:
                    last_key = body[str_start:i + 1]
            continue
        if c == '"':
            in_str, str_start = True, i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0 and val_start >= 0:
                spans[key], val_start = _trim(body, val_start, i), -1
        elif c == ":" and depth == 1 and val_start < 0:
            key, val_start = _loads_str(last_key), i + 1
        elif c == "," and depth == 1 and val_start >= 0:
            spans[key], val_start = _trim(body, val_start, i), -1
    if val_start >= 0:
        start = _trim(body, val_start, len(body))[0]
        spans[key] = (start, None)
    return spans


def _trim(body: str, start: int, end: int) -> tuple[int, int]:
    while start < end and body[start].isspace():
        start += 1
    while end > start and body[end - 1].isspace():
        end -= 1
    return start, end


_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8(value: Any) -> Any:
    """``value`` (from json.loads) with lone surrogates replaced by U+FFFD: a model may write
    ``"\\ud800"``, which json.loads accepts and no UTF-8 encoder (the response's) takes."""
    if isinstance(value, str):
        return (value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
                if _SURROGATE.search(value) else value)
    if isinstance(value, list):
        return [_utf8(v) for v in value]
    if isinstance(value, dict):
        return {_utf8(k): _utf8(v) for k, v in value.items()}
    return value


def _loads_str(quoted: str) -> str:
    try:
        value = _utf8(json.loads(quoted))
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


def parse_block(body: str) -> ToolCall | None:
    """One call from the JSON between the markers, or None if it is not a call."""
    try:
        obj = _utf8(json.loads(body))
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    span = top_level_spans(body).get("arguments") or top_level_spans(body).get("parameters")
    raw = body[span[0]:span[1]] if span and span[1] is not None else json.dumps(args)
    return ToolCall(obj["name"], raw)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished answer into (content or None, tool calls)."""
    if START not in text:
        return text, []
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = parse_block(m.group(1).strip())
        if call is None:
            continue  # not a call: leave the block in the content
        content.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    if not calls:
        return text, []
    content.append(text[pos:])
    rest = "".join(content).strip()
    return (rest or None), calls


def _held(buf: str, marker: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class StreamingToolParser:
    """Turns text deltas into content deltas and OpenAI tool-call deltas.

    `feed(text)` and `finish()` return (content, tool_call_deltas). The first delta
    of call i carries index, id, type and function.name (arguments ""); later
    ones carry only index and function.arguments fragments.
    """

    def __init__(self, forced: bool = False, name: str | None = None) -> None:
        # forced: the answer is grammar-constrained to calls (tool_choice "required" or a named
        # function), so an unfinished block at the end (max_tokens) is never content; name:
        # the named function, announced at the end if the model had not written it yet
        self.forced, self.name = forced, name
        self.buf = ""  # content text held back: it may start a <tool_call>
        self.body: str | None = None  # text of the open call block, None outside one
        self.calls: list[ToolCall] = []
        self.sent = 0  # chars of the open call's arguments already streamed
        self.announced = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, deltas = "", []
        while text:
            if self.body is None:
                self.buf += text
                text = ""
                i = self.buf.find(START)
                if i < 0:
                    keep = _held(self.buf, START)
                    content += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content += self.buf[:i]
                text, self.buf, self.body = self.buf[i + len(START):], "", ""
                self.sent, self.announced = 0, False
            else:
                self.body += text
                text = ""
                j = self.body.find(END)
                if j < 0:
                    deltas += self._progress(self.body[:len(self.body) - _held(self.body, END)])
                    break
                text = self.body[j + len(END):]
                c, d = self._close(self.body[:j])
                content, deltas = content + c, deltas + d
        # forced: the grammar allows only calls and the newlines between them, never content
        return ("" if self.forced else content), deltas

    def _announce(self, name: str, args: str = "") -> dict[str, Any]:
        self.calls.append(ToolCall(name, args))
        self.announced = True
        call = self.calls[-1]
        return {"index": len(self.calls) - 1, "id": call.id, "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _args_delta(self, raw: str) -> list[dict[str, Any]]:
        """Stream what is new in raw (the arguments so far, a prefix of the final)."""
        frag = raw[self.sent:]
        if not frag:
            return []
        self.sent = len(raw)
        self.calls[-1].arguments = raw
        return [{"index": len(self.calls) - 1, "function": {"arguments": frag}}]

    def _progress(self, body: str) -> list[dict[str, Any]]:
        spans = top_level_spans(body)
        out: list[dict[str, Any]] = []
        if not self.announced:
            name = spans.get("name")
            if name is None or name[1] is None:
                return out
            value = _loads_str(body[name[0]:name[1]])
            if not value:
                return out
            out.append(self._announce(value))
        args = spans.get("arguments") or spans.get("parameters")
        if args and body[args[0]:args[0] + 1] in ("{", "["):
            end = args[1] if args[1] is not None else len(body)
            out += self._args_delta(body[args[0]:end].rstrip())
        return out

    def _close(self, body: str) -> tuple[str, list[dict[str, Any]]]:
        """A block ended: finish its call, or give it back as content."""
        self.body = None
        call = parse_block(body.strip())
        if call is None:
            return ("", []) if self.announced else (START + body + END, [])
        out = [] if self.announced else [self._announce(call.name)]
        return "", out + self._args_delta(call.arguments)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """End of generation: release held content or the rest of an open call."""
        if self.body is None:
            content, self.buf = self.buf, ""
            if self.forced:  # a held prefix of START, cut short
                return "", [self._announce(self.name)] if self.name and not self.calls else []
            return content, []
        body, self.body = self.body, None
        if not self.announced:
            if self.forced:
                return "", [self._announce(self.name)] if self.name else []
            return START + body, []
        return "", []


def parse_cut_calls(text: str, name: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """A constrained answer ("required" / named), whole or cut short by max_tokens: the calls
    as the streaming parser has them (an open one with its partial arguments text, as vLLM
    returns a named call cut short), never content (the grammar allows none)."""
    parser = StreamingToolParser(forced=True, name=name)
    content = parser.feed(text)[0] + parser.finish()[0]
    return content.strip() or None, parser.calls


def partial_object(arguments: str) -> dict[str, Any]:
    """The arguments JSON as an object, or, when it was cut short, the object of its
    completed top-level members (``{}`` when none): Anthropic's tool_use input must be one."""
    try:
        value = _utf8(json.loads(arguments or "{}"))
        return value if isinstance(value, dict) else {}
    except ValueError:
        pass
    out: dict[str, Any] = {}
    if arguments.lstrip().startswith("{"):
        for key, (start, end) in top_level_spans(arguments).items():
            if end is not None:
                try:
                    out[key] = _utf8(json.loads(arguments[start:end]))
                except ValueError:
                    pass
    return out
