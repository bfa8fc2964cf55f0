"""What a KV event stream says is cached now, as one batch a late subscriber can apply.

vLLM's replay socket answers "every batch from seq N" out of a bounded buffer (10,000
steps by default), so a router that (re)starts after the buffer wrapped cannot rebuild its
index from the log. `HeldBlocks` follows the batches a publisher sends and can give, at
any point, a snapshot batch: ``AllBlocksCleared`` followed by one ``BlockStored`` per run
of chained blocks and medium, in the order they were stored. Applied by any consumer of
vLLM events (it is an ordinary batch), it leaves exactly the blocks the stream implies.

Semantics kept from the engine: ``AllBlocksCleared`` resets the device prefix cache
(medium ``GPU``, or unnamed), not the CPU or disk tiers, whose blocks are still there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agentserve.kv.events import (AllBlocksCleared, BlockRemoved, BlockStored, ExternalBlockHash,
                                  KVEvent, KVEventBatch)

DEVICE_MEDIA = (None, "GPU")  # what AllBlocksCleared clears (the device block pool)
Key = tuple[int, ExternalBlockHash]  # (KV cache group, block hash)


@dataclass(slots=True)
class _Block:
    parent: ExternalBlockHash | None
    tokens: tuple[int, ...]
    extra: tuple | None
    meta: tuple  # the BlockStored fields a run of blocks shares (block size, LoRA, group...)
    media: list[str | None]


def _meta(ev: BlockStored) -> tuple:
    return (ev.block_size, ev.lora_id, ev.lora_name, ev.group_idx, ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window, ev.locality, ev.ownership, ev.session_id)


class HeldBlocks:
    """The blocks a KV event stream holds, per medium, in store order."""

    def __init__(self) -> None:
        self._blocks: dict[Key, _Block] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: Iterable[KVEvent]) -> None:
        """Fold one batch's events in, in order."""
        for ev in events:
            if isinstance(ev, BlockStored):
                self._store(ev)
            elif isinstance(ev, BlockRemoved):
                group = ev.group_idx or 0
                for h in ev.block_hashes:
                    self._drop((group, h), ev.medium)
            elif isinstance(ev, AllBlocksCleared):
                for key in [k for k, b in self._blocks.items()
                            if any(m in DEVICE_MEDIA for m in b.media)]:
                    for m in DEVICE_MEDIA:
                        self._drop(key, m)

    def _store(self, ev: BlockStored) -> None:
        n, bs, group = len(ev.block_hashes), ev.block_size, ev.group_idx or 0
        # Tokens per block when the event carries them all (vLLM does); else none kept.
        whole = bs > 0 and len(ev.token_ids) == n * bs
        extras = ev.extra_keys if ev.extra_keys is not None and len(ev.extra_keys) == n else None
        meta, parent = _meta(ev), ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            b = self._blocks.get((group, h))
            if b is None:
                tokens = tuple(ev.token_ids[i * bs:(i + 1) * bs]) if whole else ()
                extra = extras[i] if extras is not None else None
                self._blocks[(group, h)] = _Block(parent, tokens, extra, meta, [ev.medium])
            elif ev.medium not in b.media:
                b.media.append(ev.medium)
            parent = h

    def _drop(self, key: Key, medium: str | None) -> None:
        b = self._blocks.get(key)
        if b is None or medium not in b.media:
            return
        b.media.remove(medium)
        if not b.media:
            del self._blocks[key]

    def snapshot(self, ts: float, rank: int | None = None) -> KVEventBatch:
        """One batch that rebuilds the held blocks from nothing: a clear, then the runs."""
        events: list[KVEvent] = [AllBlocksCleared()]
        media: list[str | None] = []
        for b in self._blocks.values():
            media += [m for m in b.media if m not in media]
        for medium in media:
            events += self._runs(medium)
        return KVEventBatch(ts, events, rank)

    def _runs(self, medium: str | None) -> list[BlockStored]:
        """Maximal runs of blocks on `medium` each chained to the one before it."""
        out: list[BlockStored] = []
        run: list[tuple[ExternalBlockHash, _Block]] = []
        for (_, h), b in self._blocks.items():
            if medium not in b.media:
                continue
            if run and (b.parent != run[-1][0] or b.meta != run[-1][1].meta):
                out.append(_stored(run, medium))
                run = []
            run.append((h, b))
        if run:
            out.append(_stored(run, medium))
        return out


def _stored(run: list[tuple[ExternalBlockHash, _Block]], medium: str | None) -> BlockStored:
    first = run[0][1]
    (bs, lora_id, lora_name, group, kind, window, locality, ownership, session) = first.meta
    tokens = [t for _, b in run for t in b.tokens] if all(b.tokens for _, b in run) else []
    return BlockStored(block_hashes=[h for h, _ in run], parent_block_hash=first.parent,
                       token_ids=tokens, block_size=bs, lora_id=lora_id, medium=medium,
                       lora_name=lora_name, extra_keys=[b.extra for _, b in run],
                       group_idx=group, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window, locality=locality,
                       ownership=ownership, session_id=session)
