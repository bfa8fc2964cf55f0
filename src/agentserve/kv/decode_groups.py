"""How a step's decodes are grouped into attention calls (no torch here: the simulator's
aggregated engines group the same way, sim/agg.py).

Each group is one block-table gather and one SDPA call over keys padded to the group's
longest context. One group for the whole batch reads `batch x longest` keys: with a long
main agent decoding beside short sub-agents, mostly padding.

Decodes whose block tables start with the same blocks (sub-agents of one burst under their
shared prompt, sessions under one system prompt: the prefix cache hands them the same
blocks) first read that shared prefix once, all their queries in one call (cascade
attention, as vLLM's); only what follows it is grouped as above (`shared_prefixes`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["DECODE_PAD_MIN_KEYS", "DECODE_PAD_SHARE", "MIN_SHARED_TOKENS", "decode_groups",
           "padded_keys", "shared_prefixes", "decode_plan", "read_keys"]

# A decode group takes the next (shorter) context while the keys it pads stay within this
# share of what it reads, or under DECODE_PAD_MIN_KEYS in all: a second call has a fixed cost
# (a gather and an SDPA launch per layer), so small savings are not split off; both numbers
# are judgements, not a measured break-even. Tiny model, 2-core CPU, contexts spread from 205 to 4,096
# (benchmarks/engine_speed.py --ctx 2048 --ctx-mix): batch 16 decoded 317-322 tok/s as one
# call, 802-818 grouped; batch 8 651-698 -> 777-806; batch 4 608-611 -> 680-709.
DECODE_PAD_SHARE = 0.25
DECODE_PAD_MIN_KEYS = 1024

# Decodes share a prefix read only when it is at least this long: the shared read is one
# more attention call per layer and a merge (~20-30 us each on the 2-core box). Tiny model,
# 2-core Xeon, one layer: 8 decodes over 1,024 shared + 256 own tokens 1.1 -> 0.55 ms; over
# 4,096 + 1,024, 25 -> 1.9 ms; 2 decodes over 2,048 + 512, 0.74 -> 0.41 ms.
MIN_SHARED_TOKENS = 1024


def decode_groups(ctx: list[int], share: float = DECODE_PAD_SHARE,
                  min_keys: int = DECODE_PAD_MIN_KEYS) -> list[list[int]]:
    """Indices into `ctx` (each decode's context length), grouped for one attention call
    each: longest first; a group takes the next context unless its padding would then exceed
    both `share` of the keys it reads and `min_keys`."""
    order = sorted(range(len(ctx)), key=lambda i: -ctx[i])
    groups: list[list[int]] = []
    top = total = 0
    for i in order:
        c = ctx[i]
        if groups:
            n = len(groups[-1]) + 1
            pad = n * top - (total + c)
            if pad <= min_keys or pad <= share * n * top:
                groups[-1].append(i)
                total += c
                continue
        groups.append([i])
        top = total = c
    return groups


def padded_keys(ctx: list[int]) -> int:
    """Keys the grouped decode attention reads for contexts `ctx`: each group's size times
    its longest context."""
    return sum(len(g) * max(ctx[i] for i in g) for g in decode_groups(ctx))


def _common(a: Sequence[Hashable], b: Sequence[Hashable], n: int) -> int:
    """Length of the common prefix of a[:n] and b[:n] (bisection over C-level slice compares:
    a shared system prompt is hundreds of blocks)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_prefixes(tables: Sequence[Sequence[Hashable]], ctx: Sequence[int], block_size: int,
                    min_tokens: int | None = None) -> list[tuple[list[int], int]]:
    """Decodes that read a shared prefix once: [(indices into `tables`, shared blocks)].

    `tables[i]` are decode i's blocks (ids or hashes), `ctx[i]` its context including the
    token it decodes. Decodes are clustered by their first block; a cluster of two or more
    shares its members' longest common prefix of whole blocks before each one's last token
    (the block a decode writes is its own), kept when it holds at least `min_tokens`
    (default MIN_SHARED_TOKENS)."""
    min_tokens = MIN_SHARED_TOKENS if min_tokens is None else min_tokens
    need = max(1, -(-min_tokens // block_size))
    by_first: dict[Hashable, list[int]] = {}
    for i, t in enumerate(tables):
        if t and min((ctx[i] - 1) // block_size, len(t)) >= need:
            by_first.setdefault(t[0], []).append(i)
    out = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        t0 = tables[members[0]]
        n = min(min((ctx[i] - 1) // block_size, len(tables[i])) for i in members)
        for i in members[1:]:
            n = _common(t0, tables[i], n)
            if n < need:
                break
        if n >= need:
            out.append((members, n))
    return out


def decode_plan(tables: Sequence[Sequence[Hashable]], ctx: Sequence[int], block_size: int,
                cascade: bool = True, min_tokens: int | None = None
                ) -> list[tuple[list[int], int]]:
    """A step's decodes as [(indices, blocks they share)]: with `cascade`, the clusters of
    `shared_prefixes`, then the rest, sharing nothing (0 blocks)."""
    plan = shared_prefixes(tables, ctx, block_size, min_tokens) if cascade else []
    clustered = {i for members, _ in plan for i in members}
    rest = [i for i in range(len(ctx)) if i not in clustered]
    return plan + ([(rest, 0)] if rest else [])


def read_keys(tables: Sequence[Sequence[Hashable]], ctx: Sequence[int], block_size: int,
              min_tokens: int | None = None, shared_floor: int = 1) -> int:
    """Keys the engine's decode attention reads for decodes (`tables`, `ctx`): each shared
    prefix once, then each cluster's remainders and the unshared decodes grouped
    (`padded_keys`). `shared_floor` rounds a shared prefix down to a multiple of that many
    tokens (the simulator's trace blocks are finer than the engine's); one that falls under
    `min_tokens` is read by each decode."""
    min_tokens = MIN_SHARED_TOKENS if min_tokens is None else min_tokens
    keys, alone = 0, []
    for members, n in decode_plan(tables, ctx, block_size, min_tokens=min_tokens):
        shared = n * block_size // shared_floor * shared_floor
        if shared < min_tokens:  # (or n == 0: the decodes that share nothing)
            alone += members
            continue
        keys += shared + padded_keys([ctx[i] - shared for i in members])
    return keys + padded_keys([ctx[i] for i in sorted(alone)])
