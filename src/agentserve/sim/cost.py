"""Cost method of the reference: each pool's rental is charged to the tokens it processes.

    $/M input  = prefill GPUs x $/GPU-hour / (input tokens per hour / 1e6)
    $/M output = decode GPUs  x $/GPU-hour / (output tokens per hour / 1e6)

Input tokens are logical prompt tokens (cached ones included), as the reference counts them.
An aggregate deployment (no P/D split) charges its whole rental to both, split by the GPU
time each kind of work used (`agg_prefill_share`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cost:
    """Dollars per million tokens and per hour of the deployment."""

    per_m_input: float | None
    per_m_output: float | None
    per_hour: float


def pool_cost(prefill_gpus: int, decode_gpus: int, input_tok_s: float, output_tok_s: float,
              price_per_gpu_hour: float = 2.71) -> Cost:
    """Disaggregated pools: prefill rental -> input tokens, decode rental -> output tokens."""

    def per_m(gpus: int, tok_s: float) -> float | None:
        return gpus * price_per_gpu_hour / (tok_s * 3600 / 1e6) if tok_s > 0 else None

    hour = (prefill_gpus + decode_gpus) * price_per_gpu_hour
    return Cost(per_m(prefill_gpus, input_tok_s), per_m(decode_gpus, output_tok_s), hour)


def aggregate_cost(gpus: int, input_tok_s: float, output_tok_s: float, agg_prefill_share: float,
                   price_per_gpu_hour: float = 2.71) -> Cost:
    """One pool doing both: its rental split by the share of busy time spent in prefill."""
    share = min(max(agg_prefill_share, 0.0), 1.0)
    return Cost(
        gpus * share * price_per_gpu_hour / (input_tok_s * 3600 / 1e6) if input_tok_s else None,
        gpus * (1 - share) * price_per_gpu_hour / (output_tok_s * 3600 / 1e6) if output_tok_s else None,
        gpus * price_per_gpu_hour,
    )
