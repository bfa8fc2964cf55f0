"""Log-probabilities in OpenAI's two response shapes (the engine computes them in sampler.py).

/v1/completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry
per token, ``top_logprobs`` a {token: logprob} dict holding the k most likely and the sampled
token (as vLLM); with ``echo`` the prompt's tokens come first, the very first without
logprobs (null). /v1/chat/completions: ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}]}``. vLLM's ``prompt_logprobs``: one entry per prompt token, null for
the first, else ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt's token
and the k most likely. Token strings are each token's own bytes, decoded (a piece of a
character shows as U+FFFD; ``bytes`` has the real bytes); -inf is sent as -9999.0, as vLLM
does, since JSON has no infinity.
"""

from __future__ import annotations

from typing import Any

from agentserve.engine.core.request import TokenLogprobs
from agentserve.prompt.tokenizer import Tokenizer

_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, _FLOOR)


def _text(tok: Tokenizer, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(tok: Tokenizer, entries: list[TokenLogprobs | int], offset: int,
                        k: int | None = None) -> tuple[dict[str, Any], int]:
    """The completions shape for ``entries``, the first at text offset ``offset``; returns
    it and the offset after them (a stream carries it from chunk to chunk). A bare token id
    is a token without logprobs (an echoed prompt's first): null entries. ``top_logprobs``:
    the token, then its entry's most likely, at most ``k`` + 1 of them (as vLLM: an echoed
    prompt's entries may hold more, with prompt_logprobs above logprobs)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        if isinstance(e, int):
            t, lp, top = _text(tok, e), None, None
        else:
            t, lp = _text(tok, e.token), _lp(e.logprob)
            top = {t: lp}
            for i, v in e.top[:None if k is None else k + 1]:
                top.setdefault(_text(tok, i), _lp(v))
            if k is not None and len(top) > k + 1:
                top = dict(list(top.items())[:k + 1])
        tokens.append(t)
        lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def echoed(prompt_ids: list[int], prompt_lps: list[TokenLogprobs | None] | None
           ) -> list[TokenLogprobs | int]:
    """An echoed prompt's entries for `completion_logprobs`: each token's prompt logprobs,
    the first token bare (and any not scored: none is, unless the request ended early)."""
    lps = prompt_lps or [None] * len(prompt_ids)
    return [t if e is None else e for t, e in zip(prompt_ids, lps)]


def prompt_logprobs(tok: Tokenizer, entries: list[TokenLogprobs | None]
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, its own entry, then the k most likely."""
    def item(token_id: int, lp: float, rank: int) -> dict[str, Any]:
        return {"logprob": _lp(lp), "rank": rank, "decoded_token": _text(tok, token_id)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token): item(e.token, e.logprob, e.rank)}
        for r, (i, v) in enumerate(e.top, 1):
            d.setdefault(str(i), item(i, v, r))
        out.append(d)
    return out


def chat_logprobs(tok: Tokenizer, entries: list[TokenLogprobs]) -> dict[str, Any]:
    """The chat shape for ``entries``."""
    def item(token_id: int, lp: float) -> dict[str, Any]:
        b = tok.token_bytes(token_id)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(lp),
                "bytes": list(b)}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(i, v) for i, v in e.top]} for e in entries]}
