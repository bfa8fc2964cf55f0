"""The mixed load of benchmarks/harden_soak.py: agent-like sessions on all four APIs.

Each client thread runs sessions one after another: 3-8 turns on one API (chat,
completions, Anthropic messages, Responses), each turn adding 30-90 new words to the
conversation, streamed or not, sometimes a forced tool call whose result the next turn
sends back, sometimes a client that leaves mid-stream, sometimes a bad request (which
must get a 4xx). Every request is bounded (`_rawhttp.send`). Outcomes are counted by
kind: ok, bad_rejected (a bad request's 4xx), disconnected (left on purpose), failed
(anything else: a wrong status, a stream without its end, a hang).
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from typing import Any

from _fuzzcases import WORDS
from _rawhttp import send

TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
               "required": ["city"]}
BAD_BODIES = [b'{"messages": [', b'{"prompt": "x", "max_tokens": -5}', b"\xff\xfe",
              b'{"model": "no-such-model", "prompt": "x"}', b"[]",
              b'{"prompt": "", "kv_transfer_params": {"remote_port": "abc"}}']
KEEP = 10


class Client:
    """One simulated agent: sessions until `stop` is set; outcomes into `counts`."""

    def __init__(self, base: str, idx: int, stop: threading.Event, counts: Counter,
                 failures: list[dict[str, Any]], lock: threading.Lock, seed: int = 0,
                 timeout: float = 30.0, deadline: float = 90.0) -> None:
        self.base, self.idx, self.stop = base, idx, stop
        self.counts, self.failures, self.lock = counts, failures, lock
        self.rng = random.Random(seed * 1000 + idx)
        self.timeout, self.deadline = timeout, deadline

    def run(self) -> None:
        while not self.stop.is_set():
            api = self.rng.choice(["chat", "completions", "messages", "responses"])
            history: list[Any] = []
            for turn in range(self.rng.randint(3, 8)):
                if self.stop.is_set():
                    return
                self._turn(api, history, turn)
                self.stop.wait(self.rng.uniform(0.05, 0.6))  # the tool's / user's time

    def _words(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(30, 90)))

    def _turn(self, api: str, history: list[Any], turn: int) -> None:
        r = self.rng.random()
        if r < 0.05:
            res = send(self.base, "POST", _PATH[api], {"Content-Type": "application/json"},
                       self.rng.choice(BAD_BODIES), self.timeout, self.deadline)
            ok = res.status is not None and 400 <= res.status < 500
            return self._count("bad_rejected" if ok else "failed", res, api)
        tools = r < 0.15 and api != "completions"
        stream = not tools and self.rng.random() < 0.5
        leave = stream and self.rng.random() < 0.1
        body = _BUILD[api](history, self._words(), tools)
        # a forced tool call needs room for its arguments; other turns are short
        body.update(max_tokens=48 if tools else self.rng.randint(4, 24), stream=stream)
        if api == "responses":
            body["max_output_tokens"] = body.pop("max_tokens")
        headers = {"Content-Type": "application/json", "x-session-id": f"soak-{self.idx}-{id(history)}"}
        res = send(self.base, "POST", _PATH[api], headers, json.dumps(body).encode(),
                   self.timeout, self.deadline, stop_after_events=2 if leave else None,
                   keep=1 << 16)
        if leave:
            return self._count("disconnected" if res.status == 200 else "failed", res, api)
        good = res.status == 200 and not res.error and (not stream or (res.done and not res.stream_errors))
        self._count("ok" if good else "failed", res, api)
        _REPLY[api](history, res.body if good and not stream else None)

    def _count(self, kind: str, res: Any, api: str) -> None:
        with self.lock:
            self.counts[kind] += 1
            if kind == "failed" and len(self.failures) < KEEP:
                self.failures.append({"api": api, "status": res.status, "error": res.error,
                                      "stream_errors": res.stream_errors[:2],
                                      "body": res.body[:300].decode("utf-8", "replace")})


_PATH = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "messages": "/v1/messages", "responses": "/v1/responses"}


def _chat(history: list[Any], text: str, tools: bool) -> dict[str, Any]:
    history.append({"role": "user", "content": text})
    body: dict[str, Any] = {"messages": list(history)}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "weather",
                                                           "parameters": TOOL_SCHEMA}}]
        body["tool_choice"] = "required"
    return body


def _completions(history: list[Any], text: str, tools: bool) -> dict[str, Any]:
    history.append(text)
    return {"prompt": "\n".join(history)}


def _messages(history: list[Any], text: str, tools: bool) -> dict[str, Any]:
    history.append({"role": "user", "content": text})
    body: dict[str, Any] = {"messages": list(history)}
    if tools:
        body["tools"] = [{"name": "weather", "input_schema": TOOL_SCHEMA}]
        body["tool_choice"] = {"type": "any"}
    return body


def _responses(history: list[Any], text: str, tools: bool) -> dict[str, Any]:
    history.append({"role": "user", "content": text})
    body: dict[str, Any] = {"input": list(history)}
    if tools:
        body["tools"] = [{"type": "function", "name": "weather", "parameters": TOOL_SCHEMA}]
        body["tool_choice"] = "required"
    return body


_BUILD = {"chat": _chat, "completions": _completions, "messages": _messages,
          "responses": _responses}


def _chat_reply(history: list[Any], raw: bytes | None) -> None:
    msg = json.loads(raw)["choices"][0]["message"] if raw else {"content": "ok"}
    calls = msg.get("tool_calls")
    history.append({"role": "assistant", "content": msg.get("content") or "",
                    **({"tool_calls": calls} if calls else {})})
    for c in calls or []:  # the tool ran: its result rides on the next turn
        history.append({"role": "tool", "tool_call_id": c["id"], "content": "sunny, 21 C"})


def _completions_reply(history: list[Any], raw: bytes | None) -> None:
    history.append(json.loads(raw)["choices"][0]["text"] if raw else "ok")


def _messages_reply(history: list[Any], raw: bytes | None) -> None:
    blocks = json.loads(raw)["content"] if raw else [{"type": "text", "text": "ok"}]
    history.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "."}]})
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "sunny, 21 C"}
               for b in blocks if b.get("type") == "tool_use"]
    if results:
        history.append({"role": "user", "content": results})


def _responses_reply(history: list[Any], raw: bytes | None) -> None:
    items = json.loads(raw)["output"] if raw else []
    for it in items:
        if it.get("type") == "function_call":
            history += [{"type": "function_call", "call_id": it["call_id"], "name": it["name"],
                         "arguments": it["arguments"]},
                        {"type": "function_call_output", "call_id": it["call_id"],
                         "output": "sunny, 21 C"}]
        elif it.get("type") == "message":
            text = "".join(c.get("text", "") for c in it.get("content", []))
            history.append({"role": "assistant", "content": text or "."})
    if not items:
        history.append({"role": "assistant", "content": "ok"})


_REPLY = {"chat": _chat_reply, "completions": _completions_reply, "messages": _messages_reply,
          "responses": _responses_reply}
