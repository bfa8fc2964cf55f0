"""What to send and when: sessions cut into steps, recorded gaps, and request bodies.

A session's items become steps: a main-agent turn, or a group of sub-agents (the
consecutive Subagent items between two main turns) that start together and that the
next main turn waits for. Gaps follow the issue's rule: the idle time the recorded
agent spent between the end of one call and the start of the next,
`t[i] - t[i-1] - api_time[i-1]`, floored at 0, then `* gap_scale`, capped at `gap_cap`.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentserve.workload.chatfit import ChatFit
from agentserve.workload.prompts import PromptBuilder, ReuseTracker, scaled_length
from agentserve.workload.record import RequestRecord
from agentserve.workload.schema import Session, Subagent, TraceRequest

Step = TraceRequest | list[Subagent]


@dataclass(slots=True)
class Job:
    """One request to send, with where it sits in its agent program."""

    session_id: str
    scope: str  # hash-id scope: the session id for local traces, "" for global ones
    block_size: int
    req: TraceRequest
    turn: int
    agent: str = "main"
    sub_index: int = -1
    offset: float = 0.0  # sub-agent start on the session clock (its requests' t are relative)
    at: float = 0.0  # schedule mode: seconds after the stage start


def scope_of(session: Session) -> str:
    return session.id if session.hash_id_scope == "local" else ""


def steps_of(session: Session, max_turns: int | None = None) -> list[Step]:
    """Main turns and sub-agent groups in order, keeping at most `max_turns` main turns."""
    steps: list[Step] = []
    turns = 0
    for it in session.items:
        if isinstance(it, Subagent):
            if steps and isinstance(steps[-1], list):
                steps[-1].append(it)
            else:
                steps.append([it])
            continue
        if max_turns is not None and turns >= max_turns:
            break
        steps.append(it)
        turns += 1
    if max_turns is not None and steps and isinstance(steps[-1], list) and turns >= max_turns:
        steps.pop()  # a trailing group belongs to the turn we cut
    return steps


def _req_end(r: TraceRequest, offset: float = 0.0) -> float:
    return offset + r.t + (r.api_time or 0.0)


def step_start(step: Step) -> float:
    """Recorded start on the session clock."""
    if isinstance(step, TraceRequest):
        return step.t
    return min(s.t for s in step)


def step_end(step: Step) -> float:
    """Recorded end on the session clock: the last call's end (sub-agents: the slowest)."""
    if isinstance(step, TraceRequest):
        return _req_end(step)
    ends = [_req_end(r, s.t) for s in step for r in s.requests]
    return max(ends) if ends else step_start(step)


def recorded_duration(steps: list[Step]) -> float:
    """Last request t + api_time - first t, sub-agents included."""
    if not steps:
        return 0.0
    return max(step_end(s) for s in steps) - step_start(steps[0])


def idle_gap(raw: float, scale: float = 1.0, cap: float | None = None) -> float:
    """Recorded idle time, floored at 0, scaled, capped."""
    g = max(0.0, raw) * scale
    return min(g, cap) if cap is not None else g


def session_jobs(session: Session, max_turns: int | None = None) -> list[Job]:
    """Every request of a session in trace order (concurrency mode sends them back to back)."""
    jobs: list[Job] = []
    scope, turn = scope_of(session), 0
    for step in steps_of(session, max_turns):
        if isinstance(step, TraceRequest):
            jobs.append(Job(session.id, scope, session.block_size, step, turn))
            turn += 1
            continue
        for k, sub in enumerate(step):
            jobs += [Job(session.id, scope, session.block_size, r, turn, "sub", k, sub.t)
                     for r in sub.requests]
    return jobs


def session_starts(sessions: list[Session], spacing: float = 0.0) -> list[float]:
    """When each session starts on a fixed schedule, in seconds: session i at i * `spacing`
    (`--session-rate`) when given; else at its recorded start (`extra["start_ms"]`, which a
    mooncake trace's timestamps become, relative to the earliest; 0 for sessions without one)."""
    if spacing:
        return [i * spacing for i in range(len(sessions))]
    ms = [float(s.extra.get("start_ms", 0.0) or 0.0) for s in sessions]
    first = min(ms, default=0.0)
    return [(m - first) / 1000.0 for m in ms]


def schedule_jobs(sessions: list[Session], spacing: float = 0.0) -> list[Job]:
    """Jobs at their recorded times (each session from `session_starts`), sorted by time."""
    jobs: list[Job] = []
    for s, start in zip(sessions, session_starts(sessions, spacing)):
        for j in session_jobs(s):
            j.at = start + j.offset + j.req.t
            jobs.append(j)
    jobs.sort(key=lambda j: j.at)
    return jobs


class RequestFactory:
    """Turns jobs into (record, body): token scaling, admission, output caps, reuse ceiling."""

    def __init__(self, model: str, api: str = "completions", vocab_size: int = 4000, seed: int = 0,
                 token_scale: int | None = None, max_input: int | None = None,
                 max_output: int | None = None, output_scale: float = 1.0,
                 chat_fit: ChatFit | None = None) -> None:
        if api == "chat" and chat_fit is None:
            raise ValueError("chat prompts need the served tokenizer's fit (workload.chatfit)")
        self.model, self.api, self.chat_fit = model, api, chat_fit
        self.prompts = PromptBuilder(vocab_size, seed)
        self.token_scale, self.max_input = token_scale, max_input
        self.max_output, self.output_scale = max_output, output_scale
        self.reuse = ReuseTracker()
        self.skipped = 0  # requests not admitted (scaled input > max_input)
        self._n = 0

    def block_tokens(self, block_size: int) -> int:
        return min(self.token_scale, block_size) if self.token_scale else block_size

    def input_length(self, job: Job) -> int:
        return scaled_length(job.req.input_tokens, job.block_size, self.block_tokens(job.block_size))

    def admit(self, job: Job) -> bool:
        """Admission as the reference: inputs above --max-input are skipped (and counted)."""
        if self.max_input is not None and self.input_length(job) > self.max_input:
            self.skipped += 1
            return False
        return True

    def build(self, job: Job, stage: int = 0) -> tuple[RequestRecord, dict]:
        """Record and JSON body for an admitted job; call it when the request is sent."""
        bt = self.block_tokens(job.block_size)
        n_in = self.input_length(job)
        out = max(1, round(job.req.output_tokens * self.output_scale))
        if self.max_output is not None:
            out = min(out, self.max_output)
        # Salt the scope with the stage so each stage starts cold on the server's cache.
        scope = f"{stage}/{job.scope}"
        rid = f"s{stage}-{self._n}"
        self._n += 1
        reusable = self.reuse.observe(scope, job.req.hash_ids, n_in, bt)
        # The agent session (stage-salted like the prompts): the server's tier policy keys
        # retention on it; `Target.send` repeats it as the `x-session-id` header.
        body: dict = {"model": self.model, "max_tokens": out, "stream": True,
                      "stream_options": {"include_usage": True}, "ignore_eos": True,
                      "user": f"{stage}/{job.session_id}"}
        if self.api == "chat":
            assert self.chat_fit is not None
            text = self.prompts.text(self.chat_fit, scope, job.req.hash_ids, n_in, bt, uid=rid)
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = self.prompts.tokens(scope, job.req.hash_ids, n_in, bt, uid=rid)
        rec = RequestRecord(request_id=rid, session_id=job.session_id, turn=job.turn, agent=job.agent,
                            sub_index=job.sub_index, stage=stage, input_tokens=n_in,
                            requested_input_tokens=n_in, reusable_tokens=reusable, max_tokens=out)
        return rec, body
