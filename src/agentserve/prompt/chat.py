"""Chat prompts (and completions text prompts) to token ids for one engine: messages as the
template expects them (`chat_messages`), the chat template rendered, then tokenized
incrementally, off the event loop.

An agent's next turn repeats every message before it, so only what it adds needs
tokenizing: the router's `IncrementalTokenizer` (prompt/incremental.py) does exactly that, and
the engine uses the same one (one implementation, so the router's renderings and the
engine's stay the same ids). Tokenizing a 240K-token conversation whole takes ~390 ms on a
2-core box; on the event loop it stalled every stream the engine was serving, on every
turn. Now a turn costs the tokenization of its new messages, in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from typing import Any

import msgspec

from agentserve.api.openai import APIError, Message, check_prompt_ids
from agentserve.prompt.tokenizer import Tokenizer, continue_final
from agentserve.prompt.incremental import IncrementalTokenizer

# conversations remembered per engine (each entry holds its ids and text: ~6 MB at 800K
# tokens); one per session the engine serves at once is what helps
PROMPT_CACHE_ENTRIES = 128


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them (as vLLM prepares them)."""
    out = []
    for m in messages:
        d: dict[str, Any] = msgspec.to_builtins(m)
        d["role"] = "system" if m.role == "developer" else m.role
        if isinstance(m.content, list):  # text parts are joined with newlines, as vLLM does
            d["content"] = "\n".join(p.text or "" for p in m.content)
        d.setdefault("content", "")
        for call in d.get("tool_calls", []):
            args = call["function"].get("arguments", "")
            if isinstance(args, str):  # HF templates expect a dict; keep text that is not JSON
                with contextlib.suppress(ValueError):
                    call["function"]["arguments"] = msgspec.json.decode(args or "{}")
        out.append(d)
    return out


class ChatPrompts:
    """One engine's chat prompts; calls are serialized (the cache is shared state)."""

    def __init__(self, tok: Tokenizer, entries: int = PROMPT_CACHE_ENTRIES) -> None:
        self.tok = tok
        self.inc = IncrementalTokenizer(tok, max_entries=entries)
        self.lock = threading.Lock()

    def ids(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            add_generation_prompt: bool = True, continue_final_message: bool = False,
            add_special_tokens: bool = False) -> list[int]:
        """The prompt's ids, as ``encode(apply_chat_template(...))`` gives them. Raises
        ValueError when the template rejects the conversation."""
        with self.lock:
            if continue_final_message or add_special_tokens:  # (rare: rendered whole)
                text = self.tok.apply_chat_template(
                    msgs, tools=tools,
                    add_generation_prompt=add_generation_prompt and not continue_final_message)
                if continue_final_message:
                    text = continue_final(text, msgs[-1].get("content") or "")
                return self.tok.encode(text, add_special_tokens=add_special_tokens)
            return self.inc.chat(msgs, tools=tools,
                                 add_generation_prompt=add_generation_prompt).ids.tolist()


    def text_ids(self, text: str, add_special_tokens: bool = True,
                 session: str | None = None) -> list[int]:
        """A completions text prompt's ids, incremental against the session's last one (or
        a prompt sharing its head), as ``encode(text, add_special_tokens)`` gives them."""
        with self.lock:
            return self.inc.text(text, add_special_tokens=add_special_tokens,
                                 session=session).ids.tolist()


_PROMPTS: weakref.WeakKeyDictionary[Any, ChatPrompts] = weakref.WeakKeyDictionary()
_MADE = threading.Lock()


def chat_prompts(engine: Any) -> ChatPrompts:
    """The engine's `ChatPrompts` (made on first use)."""
    with _MADE:
        p = _PROMPTS.get(engine)
        if p is None:
            p = _PROMPTS[engine] = ChatPrompts(engine.tokenizer)
        return p


async def chat_prompt_ids(engine: Any, msgs: list[dict[str, Any]],
                          tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True,
                          continue_final_message: bool = False) -> list[int]:
    """`ChatPrompts.ids` in a worker thread, checked there (``check_prompt_ids``); a
    template's refusal is a 400 on messages."""
    def run() -> list[int]:
        ids = chat_prompts(engine).ids(msgs, tools, add_generation_prompt, continue_final_message)
        check_prompt_ids(ids, engine.tokenizer.vocab_size, "messages")
        return ids

    try:
        return await asyncio.to_thread(run)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
