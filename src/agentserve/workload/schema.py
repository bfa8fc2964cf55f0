"""In-memory shape of an agentic trace, shared by loaders, statistics, synthesizer and replay.

One `Session` per agent program. Its `items` are, in order, main-agent requests
(`TraceRequest`) and sub-agent entries (`Subagent`), exactly as the Weka format
lists them. A sub-agent's own requests carry times relative to the sub-agent start.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TraceRequest:
    """One LLM call: its input as hash ids (one per `block_size` tokens) and its output length."""

    t: float  # seconds from the session (or sub-agent) start
    input_tokens: int
    output_tokens: int
    hash_ids: list[int]
    api_time: float | None = None  # seconds the recorded call took
    think_time: float | None = None
    kind: str = "n"  # "n" normal, "s" streaming
    model: str | None = None
    stop: str | None = None
    ttft: float | None = None
    extra: dict = field(default_factory=dict)  # fields we carry but do not interpret


@dataclass(slots=True)
class Subagent:
    """A sub-agent entry: started at `t` (session clock), its requests timed from its own start."""

    t: float
    requests: list[TraceRequest]
    agent_id: str | None = None
    subagent_type: str | None = None
    duration_ms: float | None = None
    status: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class Session:
    """One agent program (a Weka trace object)."""

    id: str
    block_size: int
    items: list[TraceRequest | Subagent]
    hash_id_scope: str = "local"  # "local": ids unique within the session; "global": shared
    extra: dict = field(default_factory=dict)

    @property
    def main_requests(self) -> list[TraceRequest]:
        return [it for it in self.items if isinstance(it, TraceRequest)]

    @property
    def subagents(self) -> list[Subagent]:
        return [it for it in self.items if isinstance(it, Subagent)]
