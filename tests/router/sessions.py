"""Drive a few multi-turn chat sessions through a router and collect what happened."""

from __future__ import annotations

import random
import time

from .procs import post

WORDS = ["def", "return", "self", "import", "class", "value", "(", ")", ":", "\n", "x", "y"]


def run_sessions(base: str, n_sessions: int = 3, turns: int = 4, seed: int = 0,
                 pause_s: float = 0.3) -> list[dict]:
    """Interleaved sessions; each turn appends a user message and the reply."""
    rng = random.Random(seed)
    import json
    import urllib.request
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    convs = [[{"role": "system", "content": f"Agent {i}. " + " ".join(
        rng.choice(WORDS) for _ in range(300))}] for i in range(n_sessions)]
    out = []
    for turn in range(turns):
        for i, msgs in enumerate(convs):
            msgs.append({"role": "user", "content": " ".join(rng.choice(WORDS)
                                                             for _ in range(40))})
            body, hdr = post(base + "/v1/chat/completions",
                             {"model": model, "messages": msgs, "max_tokens": 8,
                              "temperature": 0}, {"x-session-id": f"s{i}"})
            msgs.append({"role": "assistant",
                         "content": body["choices"][0]["message"]["content"] or "ok"})
            out.append({"session": i, "turn": turn, "endpoint": hdr["x-agentserve-endpoint"],
                        "predicted": int(hdr["x-agentserve-predicted-cached"]),
                        "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                        "prompt": body["usage"]["prompt_tokens"]})
        time.sleep(pause_s)
    return out
