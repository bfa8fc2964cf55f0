"""The disk tier's startup scan and read path on what a crash, a full disk or bit rot
leaves: nothing in the folder stops the scan, damaged segments are removed and counted,
files left in place are never written into, and a bad record is a miss, never an error."""

from __future__ import annotations

import logging
import zlib

import torch

from agentserve.kv.offload.disk import FILE_HDR_SIZE, REC_HDR, REC_HDR_SIZE, REC_MAGIC, DiskTier
from agentserve.kv.offload.manager import OffloadManager
from agentserve.kv.offload.policies import LRUPolicy
from agentserve.kv.offload.tiers import CPUTier


def K(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _disk(root, fingerprint: bytes = b"model-A") -> DiskTier:
    # 8 blocks of 64 bytes: 4 segments of 2 slots
    return DiskTier(root, capacity_bytes=8 * (REC_HDR_SIZE + 64), payload_bytes=64,
                    fingerprint=fingerprint)


def _put(d: DiskTier, key: bytes, fill: int) -> None:
    loc, _, dead = d.reserve(key)
    assert loc is not None
    if dead is not None:
        d.delete_segment(dead)
    d.write_block(key, loc, bytes([fill]) * 64)
    d.commit(key, True)


def test_scan_skips_damaged_foreign_unreadable_and_stray_segments(tmp_path, caplog) -> None:
    d = _disk(tmp_path)
    for i in range(3):  # seg 0: K0, K1; seg 1: K2
        _put(d, K(i), i)
    other = _disk(tmp_path / "other", fingerprint=b"model-B")
    _put(other, K(9), 9)
    (tmp_path / "seg-00000005.kv").write_bytes(b"")  # D5: created, then the disk was full
    (tmp_path / "seg-00000006.kv").write_bytes(b"ASKVSEG1\x01\x00")  # torn file header
    (tmp_path / "seg-00000007.kv").write_bytes(b"\x00" * 200)  # not our magic
    (tmp_path / "seg-00000008.kv").write_bytes(other.path(0).read_bytes())  # another model
    (tmp_path / "seg-00000009.kv").mkdir()  # cannot be read (a permission, as root)
    (tmp_path / "seg-00000010.kv").write_bytes(d._file_header())  # no record yet
    (tmp_path / "seg-12.kv").write_bytes(b"junk")  # a name this tier never writes
    (tmp_path / "notes.txt").write_text("not ours")

    d2 = _disk(tmp_path)
    with caplog.at_level(logging.WARNING, logger="agentserve.kv.offload.disk"):
        assert d2.scan() == [K(0), K(1), K(2)]
    assert d2.skipped == {"damaged": 3, "foreign": 1, "unreadable": 1, "stray": 1}
    for n in ("00000005", "00000006", "00000007", "00000008", "00000009"):  # once, with the path
        assert sum(f"seg-{n}.kv" in r.getMessage() for r in caplog.records) == 1
    assert d2.read_block(K(2), d2.index[K(2)]) == bytes([2]) * 64
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != "other")
    assert names == ["notes.txt", "seg-00000000.kv", "seg-00000001.kv", "seg-00000008.kv",
                     "seg-00000009.kv", "seg-12.kv"]  # damaged and empty ones removed
    # new segments never take the id of a file left in place
    loc, _, _ = d2.reserve(K(3))
    assert loc is not None and loc.segment == 11
    d2.write_block(K(3), loc, bytes([3]) * 64)
    d2.commit(K(3), True)
    d3 = _disk(tmp_path)
    assert d3.scan() == [K(0), K(1), K(2), K(3)]
    assert K(9) not in d3.index  # the other model's block is never served


def test_scan_of_an_empty_folder_and_counts_reach_the_stats(tmp_path) -> None:
    d = _disk(tmp_path)
    assert d.scan() == [] and d.skipped == {}
    (tmp_path / "seg-00000003.kv").write_bytes(b"")
    d = _disk(tmp_path)
    assert d.scan() == []
    cpu = CPUTier(2, (64,), torch.uint8, LRUPolicy())
    mgr = OffloadManager(cpu, d, block_size=4)
    mgr.adopt_disk_keys([], None)
    assert mgr.stats.disk_segments_skipped["damaged"] == 1
    assert d.reserve(K(1))[0].segment == 4  # ids only grow, even past a removed file


def _rewrite_header(d: DiskTier, key: bytes, **fields) -> None:
    """Replace ``key``'s record header with one whose CRC is valid but fields differ."""
    loc = d.index[key]
    vals = dict(magic=REC_MAGIC, klen=len(key), key=key.ljust(32, b"\0"), plen=64,
                pcrc=zlib.crc32(bytes([1]) * 64))
    vals.update(fields)
    hdr = REC_HDR.pack(vals["magic"], vals["klen"], vals["key"], vals["plen"], vals["pcrc"])
    with open(d.path(loc.segment), "r+b") as f:
        f.seek(FILE_HDR_SIZE + loc.index * d.stride)
        f.write(hdr + zlib.crc32(hdr).to_bytes(4, "little"))


def test_read_block_is_a_miss_on_wrong_length_other_key_or_missing_file(tmp_path) -> None:
    d = _disk(tmp_path)
    _put(d, K(1), 1)
    assert d.read_block(K(1), d.index[K(1)]) == bytes([1]) * 64
    assert d.read_block(K(1)[:16], d.index[K(1)]) is None  # hash length differs
    _rewrite_header(d, K(1), plen=32)  # a payload of the wrong length
    assert d.read_block(K(1), d.index[K(1)]) is None
    _rewrite_header(d, K(1), klen=16)  # the record names a shorter hash
    assert d.read_block(K(1), d.index[K(1)]) is None
    _rewrite_header(d, K(1))  # sound again
    assert d.read_block(K(1), d.index[K(1)]) == bytes([1]) * 64
    d.path(0).unlink()
    assert d.read_block(K(1), d.index[K(1)]) is None
