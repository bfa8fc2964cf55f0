"""Disk tier: offload blocks in segment files; a persistent prefix cache.

Layout of ``DIR/seg-<id>.kv``: a file header (magic, version, layout fingerprint,
block payload size, slots per segment), then fixed-stride records; record ``i`` is a
record header (magic, hash length, hash, payload length, payload CRC32, header CRC32)
followed by the payload. Segments fill in order; eviction deletes the oldest whole
segment (FIFO by write time: cheap, no fragmentation, and a chain is written
head-first so its head goes first -- the CPU tier above is where retention is smart).

Crash safety without fsync per block: the payload is written *before* its header.
A process killed mid-block leaves a payload without a valid header (skipped at scan)
or, never the reverse; a torn or bit-rotted payload fails its CRC when read, is
counted and treated as a miss. A restart rebuilds the index by scanning headers.
The fingerprint (model layout, dtype, hash seed) keeps a different model's blocks out.

Startup (``scan``) never fails on what the folder holds. Records with a bad header or cut
off by the end of the file are counted (``corrupt_at_scan``) and skipped. Whole files are
skipped, logged once with their path and counted by reason in ``skipped``: ``damaged``
(our name, but empty, a torn header or not our magic: what a crash or a full disk leaves;
deleted, so its room is reused), ``foreign`` (another model layout or format version; left
as it is), ``unreadable`` (cannot be opened or read, e.g. a folder or a permission; left),
``stray`` (``seg-*.kv`` but not a name this tier writes; left). A segment with a valid
header and no valid record is deleted without counting. Ids of files left in place are
never reused, so nothing is written into them. Files not named ``seg-*.kv`` are not touched.

Index metadata lives on the engine-core thread; file I/O runs on worker threads via
``write_block``/``read_block``/``delete_segment``, which touch no metadata.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from agentserve.kv.offload.policies import Key, PinCounts

log = logging.getLogger("agentserve.kv.offload.disk")

FILE_MAGIC, REC_MAGIC, VERSION = b"ASKVSEG1", b"BLK1", 1
FILE_HDR = struct.Struct("<8sI32sQI")  # magic, version, fingerprint, payload bytes, slots
REC_HDR = struct.Struct("<4sB3x32sQI")  # magic, hash len, hash, payload len, payload crc
REC_HDR_SIZE = REC_HDR.size + 4  # + header crc32
FILE_HDR_SIZE = 64


@dataclass(slots=True, frozen=True)
class Loc:
    segment: int
    index: int


class DiskTier:
    """Index of blocks on disk plus the pure file operations the workers run."""

    medium = "DISK"

    def __init__(self, root: str | Path, capacity_bytes: int, payload_bytes: int,
                 fingerprint: bytes, segment_bytes: int = 64 << 20) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.payload_bytes, self.fingerprint = payload_bytes, fingerprint.ljust(32, b"\0")[:32]
        self.stride = REC_HDR_SIZE + payload_bytes
        cap_blocks = max(1, capacity_bytes // self.stride)
        self.slots_per_segment = max(1, min(segment_bytes // self.stride, cap_blocks // 4 or 1))
        self.max_segments = max(1, cap_blocks // self.slots_per_segment)
        self.index: dict[Key, Loc] = {}
        self.segments: dict[int, list[Key]] = {}  # segment id -> keys written there (ordered)
        self.pending: set[Key] = set()  # reserved, write not finished
        self.pins = PinCounts()
        self.writable, self.corrupt_at_scan = True, 0
        self.skipped: dict[str, int] = {}  # segments skipped at scan, by reason (scan)
        self._open_seg, self._next_index = -1, self.slots_per_segment

    # ---- metadata (core thread) -----------------------------------------------------
    def contains(self, key: Key) -> bool:
        return key in self.index and key not in self.pending

    def pin(self, key: Key) -> None:
        self.pins.pin(key)

    def unpin(self, key: Key) -> None:
        self.pins.unpin(key)

    def reserve(self, key: Key) -> tuple[Loc | None, list[Key], int | None]:
        """A location for ``key``: (loc or None, evicted keys, segment to delete or None)."""
        if not self.writable or key in self.index:
            return None, [], None
        evicted, dead = [], None
        if self._next_index >= self.slots_per_segment:
            if len(self.segments) >= self.max_segments:
                oldest = min(self.segments)
                keys = self.segments[oldest]
                if any(k in self.pins or k in self.pending for k in keys):
                    return None, [], None  # oldest segment busy: skip this write
                for k in keys:
                    if self.index.get(k, Loc(-1, 0)).segment == oldest:
                        del self.index[k]
                        evicted.append(k)
                del self.segments[oldest]
                dead = oldest
            self._open_seg = max([self._open_seg, *self.segments]) + 1
            self.segments[self._open_seg] = []
            self._next_index = 0
        loc = Loc(self._open_seg, self._next_index)
        self._next_index += 1
        self.index[key] = loc
        self.segments[loc.segment].append(key)
        self.pending.add(key)
        return loc, evicted, dead

    def commit(self, key: Key, ok: bool) -> None:
        self.pending.discard(key)
        if not ok:
            self.index.pop(key, None)

    def forget(self, key: Key) -> None:
        """A block found corrupt: never serve it again."""
        self.index.pop(key, None)

    def disable(self, reason: str) -> None:
        if self.writable:
            log.error("disk KV tier at %s disabled: %s; serving continues without disk writes",
                      self.root, reason)
        self.writable = False

    # ---- files (worker threads) -----------------------------------------------------
    def path(self, segment: int) -> Path:
        return self.root / f"seg-{segment:08d}.kv"

    def _file_header(self) -> bytes:
        hdr = FILE_HDR.pack(FILE_MAGIC, VERSION, self.fingerprint, self.payload_bytes,
                            self.slots_per_segment)
        return hdr.ljust(FILE_HDR_SIZE, b"\0")

    def write_block(self, key: Key, loc: Loc, payload: bytes | memoryview) -> None:
        """Write one record: payload first, header last (see module doc). Raises OSError."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload is {len(payload)} bytes, disk tier expects "
                             f"{self.payload_bytes}")
        path = self.path(loc.segment)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if loc.index == 0 or os.fstat(fd).st_size < FILE_HDR_SIZE:
                os.pwrite(fd, self._file_header(), 0)
            off = FILE_HDR_SIZE + loc.index * self.stride
            os.pwrite(fd, payload, off + REC_HDR_SIZE)
            hdr = REC_HDR.pack(REC_MAGIC, len(key), key.ljust(32, b"\0")[:32], len(payload),
                               zlib.crc32(payload))
            os.pwrite(fd, hdr + struct.pack("<I", zlib.crc32(hdr)), off)
        finally:
            os.close(fd)

    def read_block(self, key: Key, loc: Loc) -> bytes | None:
        """The payload, or None if missing, truncated or failing its checksum."""
        try:
            with open(self.path(loc.segment), "rb") as f:
                f.seek(FILE_HDR_SIZE + loc.index * self.stride)
                raw = f.read(self.stride)
        except OSError:
            return None
        rec = _parse_header(raw[:REC_HDR_SIZE])
        if rec is None or rec[0] != key or rec[1] != self.payload_bytes \
                or len(raw) != self.stride:
            return None  # another key (hash length or bytes), a wrong length, torn
        payload = raw[REC_HDR_SIZE:]
        return payload if zlib.crc32(payload) == rec[2] else None

    def delete_segment(self, segment: int) -> None:
        try:
            self.path(segment).unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not delete disk KV segment %s: %s", self.path(segment), e)

    # ---- startup ----------------------------------------------------------------------
    def scan(self) -> list[Key]:
        """Rebuild the index from existing segments; returns the keys found (oldest first).

        Never raises on what the folder holds: each segment that cannot be used is skipped,
        logged once and counted in ``skipped`` by reason (module doc, "Startup"); segment
        ids found on disk are never reused, so no new segment is written over a kept file.
        """
        found: list[Key] = []
        top = -1
        for path in sorted(self.root.glob("seg-*.kv")):
            seg = _segment_id(path.name)
            if seg is None:
                self._skip("stray", path, "not a segment name this tier writes")
                continue
            top = max(top, seg)
            try:
                found += self._scan_segment(seg, path)
            except OSError as e:
                self._skip("unreadable", path, str(e))
        self._open_seg = max(top, *self.segments) if self.segments else top
        self._next_index = self.slots_per_segment  # never append into an old file
        while len(self.segments) > self.max_segments:  # capacity shrank since last run
            oldest = min(self.segments)
            for k in self.segments.pop(oldest):
                self.index.pop(k, None)
            self.delete_segment(oldest)
        return [k for k in found if k in self.index]

    def _scan_segment(self, seg: int, path: Path) -> list[Key]:
        """Index one segment's valid records (raises OSError if it cannot be read)."""
        with open(path, "rb") as f:
            head = f.read(FILE_HDR_SIZE)
            if len(head) < FILE_HDR.size or head[:8] != FILE_MAGIC:
                # A crash between creating the file and writing its header (or a full disk)
                # leaves it empty or torn: nothing in it can be served.
                why = "not a segment file (magic)" if len(head) >= FILE_HDR.size \
                    else f"empty or torn header ({len(head)} bytes)"
                self._skip("damaged", path, f"{why}; removed")
                self.delete_segment(seg)
                return []
            _, ver, fp, payload, slots = FILE_HDR.unpack(head[:FILE_HDR.size])
            if ver != VERSION or fp != self.fingerprint or payload != self.payload_bytes:
                self._skip("foreign", path, "another model layout or format version; kept")
                return []
            size, recs = os.fstat(f.fileno()).st_size, []
            for i in range(slots):  # bounded by the file's size too
                off = FILE_HDR_SIZE + i * self.stride
                if off + REC_HDR_SIZE > size:
                    break
                f.seek(off)
                rec = _parse_header(f.read(REC_HDR_SIZE))
                if rec is None or rec[1] != payload or off + self.stride > size:
                    self.corrupt_at_scan += rec is not None or off + self.stride <= size
                    continue
                recs.append((rec[0], Loc(seg, i)))
        if not recs:  # created, then killed before its first record: reuse its room
            self.delete_segment(seg)
            return []
        for key, loc in recs:  # indexed only once the whole file was read
            self.index[key] = loc
        keys = [k for k, _ in recs]
        self.segments[seg] = keys
        return keys

    def _skip(self, reason: str, path: Path, why: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        log.warning("disk KV tier: skipping %s segment %s: %s", reason, path, why)


def _segment_id(name: str) -> int | None:
    """The id in a name ``seg-<8 digits>.kv`` this tier writes, else None."""
    digits = name[4:-3]
    if len(digits) != 8 or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


def _parse_header(raw: bytes) -> tuple[Key, int, int] | None:
    """(key, payload length, payload crc) of a valid record header, else None."""
    if len(raw) != REC_HDR_SIZE:
        return None
    hdr, (crc,) = raw[:REC_HDR.size], struct.unpack("<I", raw[REC_HDR.size:])
    if zlib.crc32(hdr) != crc:
        return None
    magic, klen, key, plen, pcrc = REC_HDR.unpack(hdr)
    if magic != REC_MAGIC or klen > 32:
        return None
    return key[:klen], plen, pcrc
