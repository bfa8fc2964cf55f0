"""Request-level types shared by the engine core, the async front and the HTTP server.

A request enters as token ids plus `SamplingParams`, lives in the scheduler as a
`Request`, and leaves as a stream of `RequestOutput` deltas.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from agentserve.engine.core.status import RequestStatus  # noqa: F401 - re-exported


class LogitsConstraint(Protocol):
    """Per-request constrained decoding (e.g. a JSON-schema grammar for tool calls).

    The runner calls `apply` on the request's logits row before sampling and
    `accept` with the sampled token afterwards. `done()` turns true once the
    grammar has been completed; the engine then finishes the request with
    finish_reason "stop".
    """

    def apply(self, logits: torch.Tensor) -> None:
        """Mask disallowed tokens in place. logits: [vocab] float."""

    def accept(self, token_id: int) -> None:
        """Advance the grammar state by one sampled token."""

    def done(self) -> bool:
        """True when no more tokens may be produced."""


@dataclass(slots=True)
class SamplingParams:
    """What to generate. Validated by the server before it reaches the engine."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    constraint: LogitsConstraint | None = None
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this per occurrence in the output
    repetition_penalty: float = 1.0  # prompt or output tokens: positive logits /, negative *
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_tokens_blocked: list[int] = field(default_factory=list)  # EOS + stop ids before min_tokens
    # Log-probabilities to return per sampled token: None off; k >= 0 the token's own and
    # the k most likely. As vLLM's default (`logprobs_mode` raw_logprobs), of the model's raw
    # distribution: before penalties, bias, grammar and temperature.
    logprobs: int | None = None
    # Log-probabilities of the prompt's tokens (each given the ones before it), with the k
    # most likely at each position: None off. As vLLM, such a request reads no cached
    # prefix (every position is computed) until its prompt is done.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def penalized(self) -> bool:
        """Whether sampling reads the sequence's tokens (penalties)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler must edit this request's logits row (`sampler.process_row`)."""
        return bool(self.constraint is not None or self.logit_bias or self.min_tokens
                    or self.penalized)


@dataclass(slots=True)
class TokenLogprobs:
    """A token's log-probability and the ``k`` most likely tokens', best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0  # the token's 1-based rank in the distribution (0: not computed)


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request's output, produced after an engine step.

    `new_token_ids` are the tokens generated since the previous delta.
    `num_cached_tokens` is the prompt prefix served from the prefix cache
    (fixed once the first token is produced).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    cached_by_tier: dict[str, int] | None = None  # gpu/cpu/disk split of num_cached_tokens
    kv_transfer_params: dict | None = None  # a finished prefill leg: where its KV waits
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    # with the first token, when asked for: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    time: float = field(default_factory=time.monotonic)
