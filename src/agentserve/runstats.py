"""Statistics over repeated runs of one experiment: bench profile runs, simulator seeds,
calibrations. One place for the mean of records and AIPerf's confidence block, so that
`agentserve bench --num-profile-runs`, `agentserve sim --seeds` and the benchmark scripts
report spread the same way.

- `mean_records`: the field-by-field mean of records (numbers averaged, dicts recursed;
  anything else, or a field some record lacks, is the first record's).
- `describe`: AIPerf's multi-run block for one figure: mean, sample std (n - 1), min, max,
  cv (None for a zero mean), se, and the Student-t confidence interval of the mean (ci_low,
  ci_high, t_critical).
- `value_at`, `spread`: a figure read from a record by its path, and `describe` of each
  named figure over records; `interval_text`: a block as "mean [ci_low, ci_high] cv".
- `t_critical`: Student's t quantile, from the regularized incomplete beta (no scipy).
"""

from __future__ import annotations

import math


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def mean_records(records: list[dict]) -> dict:
    """Field-by-field mean of `records` (numbers averaged, nested dicts recursed; anything
    else, or a field some record lacks, is the first record's)."""
    out = {}
    for k, v in records[0].items():
        others = [r.get(k) for r in records[1:]]
        if isinstance(v, dict) and all(isinstance(w, dict) for w in others):
            out[k] = mean_records([v, *others])
        elif _is_num(v) and all(_is_num(w) for w in others):
            out[k] = (v + sum(others)) / len(records)
        else:
            out[k] = v
    return out


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz; converges
    in a few dozen terms for x < (a + 1) / (a + b + 2), where it is used)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1, a - 1
    c, d = 1.0, 1 - qab * x / qap
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):  # bounded; |delta - 1| < 1e-15 well before
        for num in (m * (b - m) * x / ((qam + 2 * m) * (a + 2 * m)),
                    -(a + m) * (qab + m) * x / ((a + 2 * m) * (qap + 2 * m))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def _t_cdf(x: float, df: int) -> float:
    """Student's t CDF at x >= 0: 1 - I_{df / (df + x^2)}(df / 2, 1 / 2) / 2."""
    return 1 - 0.5 * _betai(df / 2, 0.5, df / (df + x * x))


def t_critical(confidence: float, df: int) -> float:
    """The two-sided critical value of Student's t: `t.ppf(1 - (1 - confidence) / 2, df)`."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence level must be between 0 and 1, got {confidence}")
    if df < 1:
        raise ValueError(f"t needs at least 1 degree of freedom, got {df}")
    target, lo, hi = 1 - (1 - confidence) / 2, 0.0, 1.0
    while _t_cdf(hi, df) < target:  # bounded: the CDF reaches any target < 1 as hi doubles
        hi *= 2
    for _ in range(60):  # bisection to well under 1e-9
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def describe(values: list[float], confidence: float = 0.95) -> dict:
    """AIPerf's aggregate block for one figure over runs: mean, std, min, max, cv, se and the
    confidence interval of the mean (Student's t; no interval from a single value)."""
    n = len(values)
    if n == 0:
        return {"n": 0, "values": []}
    mean = sum(values) / n
    out = {"n": n, "mean": mean, "min": min(values), "max": max(values), "values": list(values)}
    if n > 1:
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        se, t = std / math.sqrt(n), t_critical(confidence, n - 1)
        # AIPerf reports inf for a zero mean; None keeps the JSON strict (no `Infinity`)
        out.update(std=std, cv=std / abs(mean) if mean else None, se=se,
                   ci_low=mean - t * se, ci_high=mean + t * se, t_critical=t)
    return out


def value_at(record: dict, path: tuple[str, ...]) -> float | None:
    """The finite number at `path` in a nested record (e.g. ("ttft_s", "p50")), else None."""
    v: object = record
    for key in path:
        v = v.get(key) if isinstance(v, dict) else None
    return float(v) if _is_num(v) and math.isfinite(v) else None


def spread(records: list[dict], paths: dict[str, tuple[str, ...]], confidence: float = 0.95) -> dict:
    """`describe` of each named figure over `records`, leaving out records that lack it."""
    return {name: describe([v for r in records if (v := value_at(r, path)) is not None], confidence)
            for name, path in paths.items()}


def interval_text(block: dict, digits: int = 3) -> str:
    """A `describe` block in a line: "mean [ci_low, ci_high] cv" ("-" with no values, the mean
    alone from a single one, no cv for a zero mean)."""
    if not block["n"]:
        return "-"
    g = f".{digits}g"
    if "ci_low" not in block:
        return format(block["mean"], g)
    cv = "" if block["cv"] is None else f" {block['cv']:.1%}"
    return f"{block['mean']:{g}} [{block['ci_low']:{g}}, {block['ci_high']:{g}}]{cv}"
