"""A request as the scheduler sees it: token ids, progress, blocks and block hashes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from agentserve.engine.core.request import RequestStatus, SamplingParams


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine core.

    `num_computed_tokens` counts tokens whose K/V is in the cache; the scheduler
    advances it. `block_hashes` holds the chained hash of every full block of
    `token_ids`, computed once per block as the sequence grows.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule; -1 = not yet scheduled
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    emitted: int = 0  # output tokens already handed to the front
    generator: object | None = None  # torch.Generator for seeded sampling
    session_id: str | None = None  # x-session-id / user: lets the tier policy see sessions
    cached_by_tier: dict[str, int] | None = None  # split of num_cached_tokens by tier
    device_hit_tokens: int = 0  # device prefix hit when a tier restore started
    kv_restore_failed: bool = False  # a restore failed once: recompute from now on
    kv_transfer: dict | None = None  # vLLM kv_transfer_params of a P/D leg (request side)
    kv_transfer_out: dict | None = None  # params returned by a prefill leg (pins held)
    kv_pull_failed: bool = False  # a remote pull failed once: recompute from now on
    logprobs: list = field(default_factory=list)  # TokenLogprobs per output token, if asked
    # TokenLogprobs per prompt position (None at 0), filled chunk by chunk, if asked
    prompt_logprobs: list | None = None
    timing: dict | None = None  # request-path stamps, only under the request trace (steptrace.py)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still computing its prompt logprobs: every prompt position must be computed
        here, not read from a cache, a tier or a remote engine (a preemption after the
        first token recomputes like any other request)."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)
