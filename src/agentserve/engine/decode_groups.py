"""How a step's decodes are grouped into attention calls (no torch here: the simulator's
aggregated engines group the same way, sim/agg.py).

Each group is one block-table gather and one SDPA call over keys padded to the group's
longest context. One group for the whole batch reads `batch x longest` keys: with a long
main agent decoding beside short sub-agents, mostly padding.
"""

from __future__ import annotations

__all__ = ["DECODE_PAD_MIN_KEYS", "DECODE_PAD_SHARE", "decode_groups", "padded_keys"]

# A decode group takes the next (shorter) context while the keys it pads stay within this
# share of what it reads, or under DECODE_PAD_MIN_KEYS in all: a second call has a fixed cost
# (a gather and an SDPA launch per layer), so small savings are not split off; both numbers
# are judgements, not a measured break-even. Tiny model, 2-core CPU, contexts spread from 205 to 4,096
# (benchmarks/engine_speed.py --ctx 2048 --ctx-mix): batch 16 decoded 317-322 tok/s as one
# call, 802-818 grouped; batch 8 651-698 -> 777-806; batch 4 608-611 -> 680-709.
DECODE_PAD_SHARE = 0.25
DECODE_PAD_MIN_KEYS = 1024


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
