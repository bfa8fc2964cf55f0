"""Tools for a chat template that has none (SmolLM2-135M-Instruct's): the Hermes/Qwen block.

Whether a template renders tools is told by rendering, not by reading its source: a probe
conversation with and without one tool of an unlikely name; the template handles tools when
the name shows up. (jinja2's ``meta.find_undeclared_variables`` only says that ``tools`` is
named somewhere, also in a branch that never prints it or that raises; the source check is
the fallback when the probe conversation itself does not render.)

For such a template the tools go into the system message (merged into the first one, or a
new one in front), as Qwen2.5's template writes them: the JSON schemas inside
<tools></tools> and the instruction to answer with <tool_call>{"name": ..., "arguments":
...}</tool_call>, the format engine/model/tools.py parses. History is rewritten the same
way: an assistant's tool_calls become <tool_call> text after its content, a ``tool``
message a user turn with <tool_response>...</tool_response>. Each message maps on its own
(no merging across messages), so renderings stay append-only for incremental rendering.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.meta

_PROBE_NAME = "zq_probe_tool_7f3a"
_PROBE_TOOLS = [{"type": "function", "function": {"name": _PROBE_NAME, "parameters": {
    "type": "object", "properties": {}}}}]
_PROBE_MSGS = [{"role": "user", "content": "hi"}]


@functools.lru_cache(maxsize=32)
def renders_tools(source: str, template: jinja2.Template) -> bool:
    """Whether the template (compiled from ``source``) puts the tools into the prompt."""
    kw = {"messages": _PROBE_MSGS, "add_generation_prompt": True, "bos_token": "",
          "eos_token": ""}
    try:
        template.render(**kw)
    except Exception:  # the probe is refused: judge by the source
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    try:
        return _PROBE_NAME in template.render(tools=_PROBE_TOOLS, **kw)
    except Exception:  # refuses tools: we render them ourselves
        return False


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The Hermes/Qwen tools instruction, as Qwen2.5's chat template writes it."""
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>{schemas}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(fn.get("name", ""))}, "arguments": {args}}}\n</tool_call>'


def hermes_messages(messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` with the tools in the system message and tool history as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        block = tools_block(tools)
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{block}" if first else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
