"""Log-probabilities in OpenAI's two response shapes (the engine computes them in sampler.py).

/v1/completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry
per token, ``top_logprobs`` a {token: logprob} dict holding the k most likely and the sampled
token (as vLLM). /v1/chat/completions: ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [...]}]}``. Token strings are each token's own bytes, decoded (a piece of a
character shows as U+FFFD; ``bytes`` has the real bytes); -inf is sent as -9999.0, as vLLM
does, since JSON has no infinity.
"""

from __future__ import annotations

from typing import Any

from agentserve.engine.request import TokenLogprobs
from agentserve.engine.tokenizer import Tokenizer

_FLOOR = -9999.0


def _lp(x: float) -> float:
    return max(x, _FLOOR)


def _text(tok: Tokenizer, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(tok: Tokenizer, entries: list[TokenLogprobs],
                        offset: int) -> tuple[dict[str, Any], int]:
    """The completions shape for ``entries``, the first at text offset ``offset``; returns
    it and the offset after them (a stream carries it from chunk to chunk)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        t = _text(tok, e.token)
        tokens.append(t)
        lps.append(_lp(e.logprob))
        top = {_text(tok, i): _lp(v) for i, v in e.top}
        top.setdefault(t, _lp(e.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def chat_logprobs(tok: Tokenizer, entries: list[TokenLogprobs]) -> dict[str, Any]:
    """The chat shape for ``entries``."""
    def item(token_id: int, lp: float) -> dict[str, Any]:
        b = tok.token_bytes(token_id)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(lp),
                "bytes": list(b)}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(i, v) for i, v in e.top]} for e in entries]}
