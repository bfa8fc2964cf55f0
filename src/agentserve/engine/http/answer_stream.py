"""A generation's answer as a stream of pieces, for the APIs whose answers are lists of
blocks (Anthropic's Messages, OpenAI's Responses): text, the start of each tool call and
its argument fragments, the tool-call parser applied. Each API maps the pieces onto its
own events (messages.py, responses.py). `prompt_cache` is the prompt's cache split both
report (Anthropic's ``cache_*_input_tokens``, the Responses API's ``input_tokens_details``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from agentserve.engine.http.serving import Generation
from agentserve.engine.model.tools import StreamingToolParser


def prompt_cache(g: Generation) -> tuple[int, int]:
    """(read, written): the prompt's tokens read from the prefix cache, and those this request
    computed and stored in it. The prefix cache is automatic (vLLM's): every full block of the
    prompt is stored, so each computed prompt token in a full block is written, whatever
    ``cache_control`` breakpoints the request marks; the last partial block's tokens are not
    stored (plain input). Nothing is written with prefix caching off."""
    engine = g.engine
    if not getattr(engine, "prefix_caching", True):
        return g.cached_tokens, 0
    full = g.prompt_tokens // engine.block_size * engine.block_size
    return g.cached_tokens, max(0, full - g.cached_tokens)


@dataclass(slots=True)
class Piece:
    """``start``: the first engine step is done (the prompt's cached tokens are known);
    ``text``: answer text; ``call``: a tool call begins (``call_id``, ``name``); ``args``:
    a fragment of the open call's JSON arguments."""

    kind: str
    text: str = ""
    call_id: str = ""
    name: str = ""


async def pieces(g: Generation, parser: StreamingToolParser | None) -> AsyncIterator[Piece]:
    """Run ``g`` and hand out its answer piece by piece (``start`` first, even when the
    answer is empty), through ``parser`` (None: no tools); leaving early aborts the request,
    as iterating ``g`` does."""

    def split(text: str, end: bool = False) -> list[Piece]:
        if parser is None:
            return [Piece("text", text)] if text else []
        content, calls = parser.finish() if end else parser.feed(text)
        out = [Piece("text", content)] if content else []
        for c in calls:
            fn = c.get("function", {})
            if "id" in c:  # the first delta of a call names it
                out.append(Piece("call", call_id=c["id"], name=fn.get("name", "")))
            if fn.get("arguments"):
                out.append(Piece("args", fn["arguments"]))
        return out

    started = False
    async with contextlib.aclosing(g.deltas()) as deltas:
        async for text, _, _ in deltas:
            if not started:
                started = True
                yield Piece("start")
            for p in split(text):
                yield p
    if not started:
        yield Piece("start")
    for p in split("", end=True):
        yield p
