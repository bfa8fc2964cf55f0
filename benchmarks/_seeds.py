"""Shared by the simulator benchmark scripts: the mean of a point's runs over seeds."""

from __future__ import annotations


def seed_mean(runs: list[dict], **key) -> dict:
    """Mean over seeds of the runs whose fields equal `key`: every numeric field but the key's
    and `seed` (each run of a pool map is one seed of one point)."""
    rr = [r for r in runs if all(r[k] == v for k, v in key.items())]
    if not rr:
        raise ValueError(f"no runs for {key}")
    return {f: sum(r[f] for r in rr) / len(rr) for f in rr[0] if f not in key and f != "seed"}
