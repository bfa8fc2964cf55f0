"""Builds one synthetic agent session from a `Profile` (see `synth` for the model).

Contexts are lists of block ids. A request's `hash_ids` list is never mutated after it is
handed out: growing a context makes a new list (kept prefix + fresh ids), so requests share
their int objects and a corpus of ~10^8 ids costs 8 bytes per id.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from agentserve.workload.schema import Session, Subagent, TraceRequest

if TYPE_CHECKING:
    from agentserve.workload.synth import Profile


def api_time(n_in: int, n_out: int) -> float:
    """Seconds a call takes: ~1 s overhead + mostly-cached prefill + 60 tok/s decode."""
    return round(1.0 + n_in * 5e-6 + n_out / 60.0, 2)


class _Ids:
    """Allocates session-local hash ids (scope "local": unique within the session)."""

    def __init__(self) -> None:
        self.next = 1

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


class _Ctx:
    """A context of `tokens` tokens: one id per block, the last block possibly partial."""

    def __init__(self, alloc: _Ids, bs: int, prefix: list[int], prefix_tokens: int,
                 tokens: int) -> None:
        self.alloc, self.bs, self.tokens = alloc, bs, tokens
        self.ids = prefix[: prefix_tokens // bs]
        self.ids += alloc.fresh(math.ceil(tokens / bs) - len(self.ids))

    def grow(self, n: int) -> None:
        keep = self.tokens // self.bs  # a partial last block changes content: new id
        self.tokens += n
        self.ids = self.ids[:keep] + self.alloc.fresh(math.ceil(self.tokens / self.bs) - keep)

    def replace_from(self, block: int, tokens: int) -> None:
        """Keep the first `block` blocks; everything after is new content (reset/compaction)."""
        self.tokens = tokens
        self.ids = self.ids[:block] + self.alloc.fresh(math.ceil(tokens / self.bs) - block)


class SessionBuilder:
    """One session: the main-agent loop, side calls, resets, compactions, sub-agent groups."""

    def __init__(self, prof: Profile, rng: np.random.Generator, sid: str,
                 max_input: int | None) -> None:
        self.p, self.rng, self.sid, self.max_input = prof, rng, sid, max_input
        self.bs = prof.block_size
        self.alloc = _Ids()
        self.sys_tokens = int(rng.integers(*prof.sys_tokens))
        self.sys_ids = self.alloc.fresh(self.sys_tokens // self.bs)
        self.sub_sys: tuple[list[int], int] | None = None
        self.n_agents = 0

    def _too_big(self, n_in: int) -> bool:
        return self.max_input is not None and n_in > self.max_input

    def build(self, turns: int, group_sizes: dict[int, int]) -> Session:
        """`group_sizes[i]`: requests of the sub-agent group launched after main turn i."""
        p, rng = self.p, self.rng
        out = np.rint(p.output.sample(rng, turns)).astype(int).clip(1, p.max_output)
        growth = np.rint(p.growth.sample(rng, (turns, p.growth_draws))).astype(int)
        growth = growth.clip(1, p.max_growth).tolist()
        gaps = p.gap.sample(rng, turns).tolist()  # python floats: they go to JSON
        kind_u = rng.random(turns).tolist()
        big = (rng.random(turns) < p.big_share).tolist()
        first = self.sys_tokens + int(p.first_message.sample(rng))
        resumed = int(min(p.resume.sample(rng), p.resume_max))
        if rng.random() < p.resume_share:  # a resumed conversation comes first
            first += resumed
        ctx = _Ctx(self.alloc, self.bs, self.sys_ids, self.sys_tokens, first)
        compact_at = p.window * float(rng.uniform(*p.compact_at))
        items: list[TraceRequest | Subagent] = []
        t, free, was_side = 0.0, 0.0, False
        for i in range(turns):
            side = False
            if i:
                side = not was_side and kind_u[i] < p.side_share
                if not side:
                    self._advance(ctx, growth[i], big[i], kind_u[i] < p.side_share + p.trim_share,
                                  compact_at)
                t = round(free + gaps[i], 3)
            n_in, ids = (self._side_call(ctx.tokens) if side else (ctx.tokens, ctx.ids))
            if self._too_big(n_in):
                break  # the limited-input variant ends the program where it outgrows the limit
            api = api_time(n_in, int(out[i]))
            items.append(TraceRequest(t=t, input_tokens=n_in, output_tokens=int(out[i]),
                                      hash_ids=ids, api_time=api,
                                      think_time=round(float(gaps[i]), 3) if i else 0.0,
                                      stop="end_turn" if i == turns - 1 else "tool_use"))
            free, was_side = t + api, side
            if i in group_sizes and i < turns - 1:
                free = self._group(items, free, group_sizes[i])
        return Session(id=self.sid, block_size=self.bs, items=items, hash_id_scope="local",
                       extra={"system_tokens": self.sys_tokens, "synthetic": p.name})

    def _advance(self, ctx: _Ctx, draws: list[int], big: bool, trim: bool,
                 compact_at: float) -> None:
        """Next main context: grow by a content growth (`pick_growth` of the draws); or
        first trim it (old tool results cleared: a prefix reset that shrinks the context);
        or compact to system prompt + summary when the window would overflow."""
        if trim:
            cut, tokens = trim_tokens(self.p, self.rng, ctx.tokens, self.sys_tokens)
            ctx.replace_from(cut // self.bs, tokens)
        g = pick_growth(draws, self.p.growth_bound * ctx.tokens, big)
        if ctx.tokens + g > compact_at:
            summary = int(np.clip(self.p.summary.sample(self.rng), 1000, 28_000 - self.sys_tokens))
            ctx.replace_from(len(self.sys_ids), self.sys_tokens + summary)
            return
        ctx.grow(g)

    def _side_call(self, context: int) -> tuple[int, list[int]]:
        """A helper request under its own prompt carrying part of the conversation
        (summaries, classifiers): a fraction of the live context, sharing no prefix."""
        n = max(200, int(context * self.rng.uniform(*self.p.side_fraction)))
        return n, self.alloc.fresh(math.ceil(n / self.bs))

    def _group(self, items: list, launch: float, size: int) -> float:
        """Append a group of concurrent sub-agents making `size` requests; returns when the
        last one finishes (the main agent waits for all of them)."""
        if self.sub_sys is None:  # one sub-agent system+tool prompt per session, shared
            n = int(self.rng.integers(*self.p.sub_sys_tokens))
            self.sub_sys = (self.alloc.fresh(n // self.bs), n)
        end = launch
        for offset, plan in group_plan(self.p, self.rng, size, self.sub_sys[1]):
            start = round(launch + offset, 3)
            sub = self._subagent(start, plan)
            if sub.requests:
                items.append(sub)
                end = max(end, start + (sub.duration_ms or 0) / 1000.0)
        return end

    def _subagent(self, start: float, plan: SubPlan) -> Subagent:
        prefix, n_sys = self.sub_sys  # type: ignore[misc]
        ctx = _Ctx(self.alloc, self.bs, prefix, n_sys, int(plan.tokens[0]))
        reqs: list[TraceRequest] = []
        for k in range(len(plan.tokens)):
            n_in = int(plan.tokens[k])
            if k:
                ctx.grow(n_in - ctx.tokens)
            if self._too_big(n_in):
                break
            reqs.append(TraceRequest(t=plan.t[k], input_tokens=n_in, output_tokens=int(plan.out[k]),
                                     hash_ids=ctx.ids, api_time=plan.api[k],
                                     think_time=plan.think[k],
                                     stop="end_turn" if k == len(plan.tokens) - 1 else "tool_use"))
        self.n_agents += 1
        dur = round((reqs[-1].t + reqs[-1].api_time) * 1000) if reqs else 0
        return Subagent(t=start, requests=reqs, agent_id=f"agent_{self.n_agents:03d}",
                        subagent_type="general-purpose", duration_ms=dur, status="completed")


class SubPlan(NamedTuple):
    """One sub-agent's requests, without ids: input tokens, outputs, start times
    (relative to the sub-agent start), call times and tool gaps."""

    tokens: list[int]
    out: list[int]
    t: list[float]
    api: list[float]
    think: list[float]

    @property
    def duration(self) -> float:
        return self.t[-1] + self.api[-1]


def pick_growth(draws: list[int], bound: float, big: bool) -> int:
    """A turn's content growth, sized to its context: the first draw, unless it exceeds
    `bound` (growth_bound x context: the turn would reuse < 90%) on a turn that is not
    `big`; then the first later draw within the bound (rejection sampling, i.e. the growth
    distribution conditioned on fitting), or the bound if none does."""
    if big or draws[0] <= bound:
        return draws[0]
    for g in draws[1:]:
        if g <= bound:
            return g
    return max(1, int(bound))


def trim_tokens(p: Profile, rng: np.random.Generator, tokens: int, sys_tokens: int
                ) -> tuple[int, int]:
    """Context editing (old tool results cleared): content from a cut point early in the
    conversation is rewritten to a fraction k ~ U(keep +- 0.15) of its length. The cut is
    uniform between the system prompt and min(1/4, 0.45 k / (0.55 + 0.45 k)) of the context,
    so the kept prefix is under half the new context: every trim is a prefix reset.
    Returns (cut, new tokens)."""
    k = float(np.clip(rng.uniform(p.trim_keep - 0.15, p.trim_keep + 0.15), 0.05, 1.0))
    hi = min(0.25, 0.45 * k / (0.55 + 0.45 * k)) * tokens
    cut = sys_tokens + int(rng.random() * max(hi - sys_tokens, 0.0))
    return cut, cut + int(k * (tokens - cut))


def group_plan(p: Profile, rng: np.random.Generator, size: int, n_sys: int
               ) -> list[tuple[float, SubPlan]]:
    """A group of `size` requests: 1 + Binomial(4, 0.35) concurrent sub-agents (at most
    `size`), requests split multinomially (each at least one), each sub-agent starting
    U(0.05, 0.5) s after launch. Used by the builder and by the gap calibration."""
    n_agents = int(min(size, 1 + rng.binomial(*p.agents_per_group)))
    counts = 1 + rng.multinomial(size - n_agents, np.full(n_agents, 1.0 / n_agents))
    return [(float(rng.uniform(0.05, 0.5)), sub_plan(p, rng, n_sys, int(n))) for n in counts]


def sub_plan(p: Profile, rng: np.random.Generator, n_sys: int, n_req: int) -> SubPlan:
    """A sub-agent context: shared sub-agent prompt + its task, growing like the main
    context (content growth only); tool gaps between its calls."""
    first = n_sys + int(p.sub_task.sample(rng))
    out = np.rint(p.output.sample(rng, n_req)).astype(int).clip(1, p.max_output).tolist()
    growth = np.rint(p.growth.sample(rng, n_req)).astype(int).clip(1, p.max_growth)
    gaps = p.sub_gap.sample(rng, n_req).tolist()
    tokens = (first + np.concatenate([[0], np.cumsum(growth[1:])])).tolist()
    ts, apis, think, t = [], [], [], 0.0
    for k in range(n_req):
        if k:
            t = round(t + apis[-1] + gaps[k], 3)
        ts.append(t)
        apis.append(api_time(tokens[k], out[k]))
        think.append(round(float(gaps[k]), 3) if k else 0.0)
    return SubPlan(tokens, out, ts, apis, think)
