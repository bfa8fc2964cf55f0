"""Synthetic agentic traces: a generative session model fitted to SPEC.md's workload table.

The model (profile `claude-code`; every marginal is quantile-matched in closed form, see
`synth_dist.Spliced`: sigma = ln(x_b/x_a)/(z_b - z_a), mu = ln x_a - sigma z_a, with a
separate upper-tail slope through p99 where the table gives one):

- Turns per session T (main-agent requests, side calls included): lognormal through
  p50 107 / p90 354, tail through p99 992. Drawn stratified over the corpus.
- Context: a system+tool prefix of 15-20K tokens (uniform; its block ids are the session's
  common prefix) plus a first user message (lognormal, p50 1.5K / p90 6K). Each later turn
  appends a growth increment (previous reply + tool result), lognormal through the table's
  growth p50 632 / p90 3,735 after removing the two extreme growths every side call causes
  (one negative, one positive): target levels (0.5 - s)/(1 - 2s) and (0.9 - s)/(1 - 2s).
  Linear growth with mean ~1.6K/turn over lognormal T reproduces the input table
  (p50 ~195K, p90 ~520K) without being fitted to it; that is the consistency check.
- Side calls (share s of turns): helper requests under their own prompt carrying a
  fraction f ~ U(0.05, 0.4) of the live context (few fall below 30K from a >500K context,
  so they do not count as compactions); each is a prefix reset, and the turn after it
  returns to the full context, a growth of (1 - f) x context. The table's growth p99
  (148K) is that return: s = 0.01 / E_f[P((1 - f) input > 148K)] under the input table's
  lognormal (s ~ 2.1%).
- Rewrites (share r = 2.8% - s): content from a uniform point between the system prefix
  and half the context is replaced (context editing); reuse < 0.5, a prefix reset.
- Compaction: when the context would pass a per-session threshold (80-95% of a 1M window),
  it becomes system prefix + summary (lognormal p50 6K, kept under 30K). Only the ~5% of
  sessions long enough reach it, giving the table's ~0.03% compactions and a p99 near 850K.
- Outputs: lognormal through p50 317 / p90 1,705 / p99 7,551.
- Gaps (idle time before a turn): lognormal through 2 s / 24 s / 11.4 min at levels
  corrected for the share p_g of turns whose gap also holds a sub-agent group's run time:
  u' = (u - p_g G(x)) / (1 - p_g), with G(x) the share of those gaps below x: 0 at 2 s,
  1 at 11.4 min, and at 24 s from the group model (sizes on a fixed quadrature, the
  busiest sub-agent's sampled call and tool times). Call time: 1 s + 5 us per input token + output at 60 tokens/s.
- Sub-agent groups: after each main turn (but the last) a group starts with probability
  p_g = R E[T] / ((E[T] - 1) E[G]), R = 40,367 / 37,732 sub-agent requests per main
  request. Group size G (requests): lognormal p50 7 / p90 51, capped at 1,000, drawn
  stratified over the corpus. A group has 1 + Binomial(4, 0.35) concurrent sub-agents
  (at most G), requests split multinomially (each at least one). Each sub-agent context is
  the session's shared sub-agent prefix (6-10K) + its task (lognormal p50 1.5K / p90 5K),
  growing like the main context; its tool gaps are lognormal p50 1 s / p90 6 s. The next
  main turn waits for the whole group.

Profile `sweep` (the reference load sweep: input p50 47-57K, p99 above 347K): the same
model with the turn distribution solved from input targets p50 52K / p99 420K: input ~
prefix + mean growth x pooled turn index, whose quantiles scale with the turn median and
depend on sigma_T only through their ratio (1-D bisection on a fixed quadrature).
`max_input` ends a session (and a sub-agent) before its first request above the limit.
Hash ids are per 64-token block, scope "local"; a partial last block gets a new id when
it fills. Same seed, same bytes: all randomness comes from one numpy SeedSequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

from agentserve.workload.schema import Session
from agentserve.workload.synth_dist import Spliced, cdf, normal_scores, stratified, z
from agentserve.workload.synth_session import SessionBuilder

# SPEC.md "The workload": the production study (219 sessions, 78,099 requests).
SPEC = {"input": (195_000, 521_000, 849_000), "output": (317, 1705, 7551),
        "growth": (632, 3735, 148_000), "gap": (2.0, 24.0, 684.0), "turns": (107, 354, 992),
        "reset": 0.028, "sub_requests": 40_367, "requests": 78_099, "group": (7, 51)}
SWEEP_INPUT = (52_000, 420_000)  # p50 within 47-57K, p99 above 347K


@dataclass(frozen=True)
class Profile:
    name: str
    turns: Spliced
    output: Spliced
    growth: Spliced
    gap: Spliced
    group_size: Spliced
    side_share: float
    rewrite_share: float
    group_prob: float
    block_size: int = 64
    sys_tokens: tuple[int, int] = (15_000, 20_001)
    first_message: Spliced = Spliced.fit([(0.5, 1500), (0.9, 6000)])
    side_fraction: tuple[float, float] = (0.05, 0.4)
    summary: Spliced = Spliced.fit([(0.5, 6000), (0.9, 12_000)])
    window: int = 1_000_000
    compact_at: tuple[float, float] = (0.80, 0.95)
    sub_sys_tokens: tuple[int, int] = (6000, 10_001)
    sub_task: Spliced = Spliced.fit([(0.5, 1500), (0.9, 5000)])
    sub_gap: Spliced = Spliced.fit([(0.5, 1.0), (0.9, 6.0)])
    agents_per_group: tuple[int, float] = (4, 0.35)
    max_output: int = 32_000
    max_growth: int = 250_000
    max_group: int = 1000


def _derive(name: str, turns: Spliced) -> Profile:
    """Every parameter below follows from SPEC's table (see the module docstring)."""
    i50, i90, _ = SPEC["input"]
    s_in = math.log(i90 / i50) / z(0.9)
    keep = 1 - (np.arange(100) + 0.5) / 100 * 0.35 - 0.05  # 1 - f, f ~ U(0.05, 0.4)
    side = 0.01 / np.mean([1 - cdf(math.log(SPEC["growth"][2] / (k * i50)) / s_in) for k in keep])
    g50, g90, _ = SPEC["growth"]
    growth = Spliced.fit([((0.5 - side) / (1 - 2 * side), g50), ((0.9 - side) / (1 - 2 * side), g90)])
    group = Spliced.fit([(0.5, SPEC["group"][0]), (0.9, SPEC["group"][1])])
    ratio = SPEC["sub_requests"] / (SPEC["requests"] - SPEC["sub_requests"])
    e_t = Spliced.fit([(0.5, SPEC["turns"][0]), (0.9, SPEC["turns"][1]),
                       (0.99, SPEC["turns"][2])]).mean(1)
    p_g = ratio * e_t / ((e_t - 1) * group.mean(1, 1000))
    out = Spliced.fit(list(zip((0.5, 0.9, 0.99), SPEC["output"])))
    p50, p90, p99 = SPEC["gap"]
    first = Spliced.fit([(0.5 / (1 - p_g), p50), (0.9 / (1 - p_g), p90)])  # if G(24) were 0
    below = 1 - _share_above(group, p90, out, first)  # share of post-group gaps <= p90
    gap = Spliced.fit([(0.5 / (1 - p_g), p50), ((0.9 - p_g * below) / (1 - p_g), p90),
                       ((0.99 - p_g) / (1 - p_g), p99)])
    return Profile(name=name, turns=turns, output=out, growth=growth, gap=gap, group_size=group,
                   side_share=side, rewrite_share=max(0.0, SPEC["reset"] - side), group_prob=p_g)


def _share_above(group: Spliced, seconds: float, out: Spliced, idle: Spliced,
                 n: int = 4000) -> float:
    """P(a post-group gap exceeds `seconds`), from the group model itself: size G on a
    fixed quadrature, agents 1 + Binomial(4, 0.35), the busiest agent's requests each a
    sampled call (15K-token context, sampled reply) plus a sampled tool gap, then the
    main agent's own idle gap. Fixed seed: a property of the model, not of the run."""
    rng = np.random.default_rng(0)
    g = np.clip(np.rint(group.ppf((np.arange(n) + 0.5) / n)), 1, 1000)
    k = np.ceil(g / np.minimum(g, 1 + rng.binomial(4, 0.35, n))).astype(int)
    calls = 1.0 + 15_000 * 5e-6 + out.sample(rng, k.sum()) / 60 + Profile.sub_gap.sample(rng, k.sum())
    starts = np.concatenate([[0], np.cumsum(k)[:-1]])
    busy = np.add.reduceat(calls, starts) + idle.sample(rng, n)
    return float(np.mean(busy > seconds))


def _spec_turns() -> Spliced:
    return Spliced.fit(list(zip((0.5, 0.9, 0.99), SPEC["turns"])))


def _sweep_turns(base: Profile) -> Spliced:
    """Lognormal T whose pooled input quantiles hit SWEEP_INPUT.

    Pooled over requests, a turn index is U * T_sb (U uniform, T_sb the size-biased T,
    lognormal(mu + sigma^2, sigma)), so input_q ~ prefix + g_mean * exp(mu) * h_q(sigma).
    The p99/p50 ratio fixes sigma (bisection); p50 then fixes mu.
    """
    n = 4001
    zs = normal_scores((np.arange(n) + 0.5) / n)
    log_u = np.log((np.arange(n) + 0.5) / n)
    prefix = np.mean(base.sys_tokens) + base.first_message.mean()
    g_mean = base.growth.mean(1, base.max_growth)
    target = (SWEEP_INPUT[1] - prefix) / (SWEEP_INPUT[0] - prefix)

    def h(sig: float) -> tuple[float, float]:
        x = (log_u[:, None] + sig * sig + sig * zs[None, ::7]).ravel()
        return tuple(np.exp(np.percentile(x, [50, 99])))

    lo, hi = 0.05, 3.0
    for _ in range(40):
        mid = (lo + hi) / 2
        h50, h99 = h(mid)
        lo, hi = (mid, hi) if h99 / h50 < target else (lo, mid)
    h50, _ = h(lo)
    return Spliced(mu=math.log((SWEEP_INPUT[0] - prefix) / (g_mean * h50)), sigma=lo)


@cache
def profile(name: str) -> Profile:
    """A named profile: `claude-code` (SPEC's table) or `sweep` (reference load sweep)."""
    if name == "claude-code":
        return _derive(name, _spec_turns())
    if name == "sweep":
        return _derive(name, _sweep_turns(_derive(name, _spec_turns())))
    raise ValueError(f"unknown profile {name!r}; choose one of: claude-code, sweep")


PROFILES = ("claude-code", "sweep")


def _plan(p: Profile, rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[dict[int, int]]]:
    """Corpus-level draws: turns per session and the group sizes after each main turn."""
    turns = np.maximum(1, np.rint(p.turns.ppf(stratified(rng, n)))).astype(int)
    slots = [np.flatnonzero(rng.random(max(t - 1, 0)) < p.group_prob) for t in turns]
    k = sum(len(s) for s in slots)
    sizes = np.clip(np.rint(p.group_size.ppf(stratified(rng, k))), 1, p.max_group).astype(int)
    plans, used = [], 0
    for s in slots:
        plans.append({int(i): int(g) for i, g in zip(s, sizes[used:used + len(s)])})
        used += len(s)
    return turns, plans


def synthesize(profile_name: str, sessions: int, seed: int = 0,
               max_input: int | None = None) -> list[Session]:
    """Generate `sessions` Weka sessions; the same arguments give the same sessions."""
    if sessions < 1:
        raise ValueError("sessions must be at least 1")
    p = profile(profile_name)
    seqs = np.random.SeedSequence(seed).spawn(sessions + 1)
    turns, plans = _plan(p, np.random.default_rng(seqs[0]), sessions)
    out = []
    for i in range(sessions):
        b = SessionBuilder(p, np.random.default_rng(seqs[i + 1]), f"synth_{i + 1:04d}", max_input)
        out.append(b.build(int(turns[i]), plans[i]))
    return out
