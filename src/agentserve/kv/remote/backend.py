"""The pluggable KV transfer interface between a prefill and a decode engine.

`TransferBackend` moves KV bytes; `BlockSource` is the prefill side's pinned blocks as a
backend sees them; `PullSpec` names what the decode side wants. `transfer_wire.TcpBackend`
implements it over TCP; a NIXL backend would implement the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class PullSpec:
    """Blocks ``idx`` of prefill request ``rid`` (with their expected hashes) at ``host:port``."""

    host: str
    port: int
    rid: str
    idx: list[int]
    hashes: list[bytes]
    release: bool = True


class BlockSource(Protocol):
    """The prefill side's pinned blocks, as the transfer server sees them (thread-safe)."""

    k: torch.Tensor  # the KV cache, [L, num_blocks, bs, H, D] each
    v: torch.Tensor

    def checkout(self, rid: str, idx: list[int], hashes: list[bytes]) -> list[int]:
        """Device block ids for ``idx``; raises TransferError if unknown or hashes differ.

        The blocks stay readable (pinned) until the matching ``checkin``."""

    def checkin(self, rid: str, release: bool) -> None:
        """The server is done reading (after ``checkout``); ``release`` frees the pins."""

    def release(self, rid: str) -> None:
        """Free the pins without reading them (the decode side needs none of them)."""

    def pinned_sums(self, rid: str, idx: list[int]) -> list[int] | None:
        """Optional: the ``block_sums`` of blocks ``idx``, computed once after pinning;
        None while they are not ready (the server then sums the bytes as it sends them)."""


class TransferBackend(Protocol):
    """How KV bytes move between engines. TCP here; a NIXL backend would implement the same
    (it registers ``k``/``v`` as memory regions and reads block descriptors remotely)."""

    name: str
    on_sent: Callable[[int], None]

    def serve(self, source: BlockSource, host: str, port: int) -> int:
        """Start serving ``source``; returns the bound port."""

    def pull_into(self, spec: PullSpec, k: torch.Tensor, v: torch.Tensor,
                  block_ids: list[int]) -> int:
        """Copy the remote blocks into local cache blocks ``block_ids``; returns the bytes
        received. Raises TransferError (the blocks' contents are then undefined)."""

    def release(self, host: str, port: int, rid: str) -> None:
        """Tell the prefill side to drop its pins for ``rid`` without reading them."""

    def close(self) -> None: ...
