"""The demo's conversations through the router: what a coding agent sees on the real model.

`coding_chat`: three greedy turns of /v1/chat/completions with a coding system prompt
(write a function, add type hints, write a pytest test), each turn sending the whole
history so the prefix cache serves what the last turn already computed (the cached
tokens grow turn by turn); then a tool turn: a `run_tests` tool with tool_choice named
(constrained decoding makes even a 135M model emit a well-formed call), the call parsed,
a tool result (made up by the demo: nothing is executed) sent back as a `tool` message
with a question about it, and the model's answer. `agent_apis`: two turns in Claude Code's API (/v1/messages)
and in Codex's (/v1/responses), run side by side, one line with each second turn's cache
reads and the start of its text.

Failures are values: a `Chat` or line that says what failed, never an exception.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rich.console import Console

SYSTEM = ("You are a helpful coding assistant. Answer with short, correct Python code and "
          "one or two sentences.")
QUESTIONS = ("Write a Python function that reverses a string.",
             "Add type hints and a docstring.",
             "Now write a pytest test for it.")
RUN_TESTS = {"type": "function", "function": {
    "name": "run_tests", "description": "Run the project's pytest tests and return the report",
    "parameters": {"type": "object", "required": ["path"], "additionalProperties": False,
                   "properties": {"path": {"type": "string", "maxLength": 40}}}}}
TOOL_ASK = "Run the tests."
# after the tool result: without a question the 135M model tends to echo <tool_response> back
TOOL_FOLLOWUP = "Why did it fail? Fix the test."
TOOL_RESULT = ("collected 1 item\n\ntest_reverse.py F\n\nFAILED test_reverse.py::test_reverse_string"
               " - AssertionError: assert 'olleH' == 'Hello'\n1 failed in 0.03s")


@dataclass(slots=True)
class Turn:
    """One request of the conversation as the client saw it."""

    ask: str
    answer: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    pulled: bool = False  # prefilled on the prefill engine, KV pulled (the router's x-agentserve-pd)
    call: str = ""  # `name(arguments)` of a parsed tool call


@dataclass(slots=True)
class Chat:
    turns: list[Turn] = field(default_factory=list)
    error: str = ""


def post(url: str, body: dict, timeout: float = 120.0, headers: dict | None = None) -> dict:
    """POST JSON, the answer's JSON; the response headers land in `headers` when given."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if headers is not None:
            headers.update(r.headers.items())
        return json.loads(r.read())


def _ask(router: str, msgs: list[dict], max_tokens: int, **extra) -> tuple[dict, Turn]:
    t0, headers = time.perf_counter(), {}
    r = post(router + "/v1/chat/completions", {"messages": msgs, "max_tokens": max_tokens,
                                               "temperature": 0, "user": "demo_chat", **extra},
             headers=headers)
    msg, u = r["choices"][0]["message"], r["usage"]
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    ask = msgs[-1]["content"] if msgs[-1]["role"] == "user" else f"({msgs[-1]['role']} result)"
    pulled = any(k.lower() == "x-agentserve-pd" for k in headers)
    return msg, Turn(ask, msg.get("content") or "", u["prompt_tokens"], cached,
                     time.perf_counter() - t0, pulled)


def coding_chat(router: str, max_tokens: int = 80) -> Chat:
    """The three coding turns and the tool turn (call, result, answer); see the module doc."""
    chat = Chat()
    msgs: list[dict] = [{"role": "system", "content": SYSTEM}]
    try:
        for q in QUESTIONS:
            msgs.append({"role": "user", "content": q})
            msg, turn = _ask(router, msgs, max_tokens)
            msgs.append({"role": "assistant", "content": turn.answer})
            chat.turns.append(turn)
        msgs.append({"role": "user", "content": TOOL_ASK})
        named = {"type": "function", "function": {"name": "run_tests"}}
        msg, turn = _ask(router, msgs, 60, tools=[RUN_TESTS], tool_choice=named)
        calls = msg.get("tool_calls") or []
        if not calls:
            chat.error = f"the tool turn gave no tool call: {msg!r}"
            return chat
        fn = calls[0]["function"]
        turn.call = f"{fn['name']}({fn['arguments']})"
        chat.turns.append(turn)
        msgs += [{"role": "assistant", "content": None, "tool_calls": calls[:1]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": TOOL_RESULT},
                 {"role": "user", "content": TOOL_FOLLOWUP}]
        chat.turns.append(_ask(router, msgs, max_tokens, tools=[RUN_TESTS])[1])
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        chat.error = f"{type(e).__name__}: {e}"
    return chat


def _trim(text: str, lines: int = 6, width: int = 100) -> str:
    rows = [r[:width] for r in text.strip().splitlines() if r.strip()]
    more = f"\n    ... ({len(rows) - lines} more lines)" if len(rows) > lines else ""
    return "\n".join("    " + r for r in rows[:lines]) + more


def print_chat(console: Console, chat: Chat) -> None:
    """Each turn: what was asked, prompt and cached tokens, the answer (a few lines)."""
    console.print("\n[bold]a coding conversation through the router[/] (greedy; each turn "
                  "resends the history, the prefix cache serves what it already computed)")
    for i, t in enumerate(chat.turns, 1):
        where = "prefilled on the prefill engine, KV pulled" if t.pulled else "decode engine"
        console.print(f"[bold]turn {i}[/] {t.ask!r}: prompt {t.prompt_tokens} tokens, "
                      f"{t.cached_tokens} cached ({where}), {t.seconds:.1f} s", highlight=False)
        if t.call:
            console.print(f"    tool call: {t.call}", markup=False, highlight=False)
            console.print("    tool result sent back (made up by the demo):",
                          TOOL_RESULT.splitlines()[-2], markup=False, highlight=False)
        else:
            console.print(_trim(t.answer, width=max(40, console.width - 5)), markup=False,
                          highlight=False)
    if chat.error:
        console.print(f"[bold red]conversation failed[/]: {chat.error}")


def _first_words(text: str, n: int = 60) -> str:
    flat = " ".join(text.split())
    return json.dumps(flat[:n] + ("..." if len(flat) > n else ""))


def _claude(router: str, system: str, max_tokens: int) -> str:
    msgs: list[dict] = []
    for ask in ("Which test runner should I use for a Python project?", "Show me how to run it."):
        msgs.append({"role": "user", "content": ask})
        m = post(router + "/v1/messages", {
            "max_tokens": max_tokens, "system": system, "messages": msgs, "temperature": 0,
            "metadata": {"user_id": "demo_session_claude"}})
        msgs.append({"role": "assistant", "content": m["content"]})
    u = m["usage"]
    text = "".join(b.get("text", "") for b in m["content"])
    prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    return (f"Claude Code's /v1/messages: turn 2 read {u['cache_read_input_tokens']} of "
            f"{prompt} prompt tokens from cache, "
            f"said {_first_words(text)}")


def _codex(router: str, system: str, max_tokens: int) -> str:
    items: list[dict] = []
    for ask in ("How do I list the files in a git repository?", "And only the Python ones?"):
        items.append({"role": "user", "content": ask})
        r = post(router + "/v1/responses", {
            "max_output_tokens": max_tokens, "instructions": system, "input": items,
            "temperature": 0, "prompt_cache_key": "demo_session_codex"})
        items += r["output"]
    u = r["usage"]
    text = "".join(c.get("text", "") for it in r["output"] if it.get("type") == "message"
                   for c in it.get("content", []))
    return (f"Codex's /v1/responses: {u['input_tokens_details']['cached_tokens']} of "
            f"{u['input_tokens']}, said {_first_words(text)}")


def agent_apis(router: str, max_tokens: int = 60) -> str:
    """Two turns in Claude Code's API (/v1/messages) and in Codex's (/v1/responses) through
    the router, the two conversations side by side: one line saying what each second turn
    read from the prefix cache and how its answer starts."""
    system = ("You are a coding agent working in a large Python repository. Be brief. "
              "Prefer standard tools. ") * 8
    try:
        with ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(f, router, system, max_tokens) for f in (_claude, _codex)]
            reads = [j.result() for j in jobs]
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        return f"agent APIs failed: {e!r}"
    return "agent APIs through the router: " + "; ".join(reads)
