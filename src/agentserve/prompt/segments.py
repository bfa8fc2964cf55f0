"""Immutable sequences kept as segments that later turns share: `Seq` (int32 token ids
and offsets) and `Rope` (prompt text).

A turn's prompt is its base's first k items plus a few hundred new ones. Building it as
(shared segments + a copied partial segment + the new segment) costs O(new), where
copying two 200K-entry arrays per turn cost ~1 ms, and concatenating a 660K-character
chat rendering cost ~0.3 ms (fresh pages for every copy). Past `max_segments` segments a
sequence is compacted into one (one copy every few dozen turns), so lookups stay cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from bisect import bisect_right
from itertools import chain
from typing import Any, Generic, TypeVar

T = TypeVar("T", array, str)


class _Segments(ABC, Generic[T]):
    """Shared machinery: segment starts, locate, slice, prefix + tail."""

    __slots__ = ("n", "segs", "starts")
    max_segments = 64

    def __init__(self, segs: list[T]) -> None:
        self.segs = [x for x in segs if len(x)]
        self.starts: list[int] = []
        n = 0
        for x in self.segs:
            self.starts.append(n)
            n += len(x)
        self.n = n

    @abstractmethod
    def _join(self, parts: list[T]) -> T:
        """One sequence of `parts` (an array is always a new one: callers may extend it)."""

    def __len__(self) -> int:
        return self.n

    def _locate(self, i: int) -> tuple[int, int]:
        j = bisect_right(self.starts, i) - 1
        return j, i - self.starts[j]

    def _slice(self, a: int, b: int) -> T:
        parts: list[T] = []
        if a < b:
            j, o = self._locate(a)
            while a < b:
                seg = self.segs[j]
                take = min(len(seg) - o, b - a)
                parts.append(seg[o:o + take] if (o or take < len(seg)) else seg)
                a, j, o = a + take, j + 1, 0
        return self._join(parts)

    def prefix_plus(self, k: int, tail: T) -> Any:
        """The first `k` items followed by `tail` (shared segments are not copied)."""
        if k >= self.n:
            segs = list(self.segs)
        else:
            j, o = self._locate(k)
            segs = self.segs[:j]
            if o:
                segs.append(self.segs[j][:o])
        segs.append(tail)
        if len(segs) > self.max_segments:
            segs = [self._join(segs)]
        return type(self)(segs)


class Seq(_Segments[array]):
    """An immutable int32 sequence: len, indexing, slicing (to an array), iteration,
    `tolist`, and `bisect_right` for the (non-decreasing) char end offsets."""

    __slots__ = ()

    def _join(self, parts: list[array]) -> array:
        out = array("i")  # always a new array: callers may extend what a slice returns
        for x in parts:
            out += x
        return out

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            a, b, step = i.indices(self.n)
            if step != 1:
                return array("i", self.tolist()[i])
            return self._slice(a, b)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("Seq index out of range")
        j, o = self._locate(i)
        return self.segs[j][o]

    def __iter__(self) -> Any:
        return chain.from_iterable(self.segs)

    def __eq__(self, other: object) -> bool:
        return self.tolist() == list(other)  # type: ignore[call-overload]

    __hash__ = None  # type: ignore[assignment]

    def tolist(self) -> list[int]:
        return self._slice(0, self.n).tolist()

    def bisect_right(self, x: int) -> int:
        """bisect_right for a non-decreasing sequence (the char end offsets), looking at
        the last segments first (the cut is almost always near the end)."""
        j = len(self.segs) - 1
        while j >= 0 and self.segs[j][0] > x:
            j -= 1
        if j < 0:
            return 0
        return self.starts[j] + bisect_right(self.segs[j], x)


class Rope(_Segments[str]):
    """Immutable text: len, slicing to a `str`, `str()`, and a bounded `endswith`.

    The incremental chat renderer only ever reads a rendering near its end (the text
    before the generation prompt, and what follows it), so a 200K-token conversation
    is never joined into one string on the hot path."""

    __slots__ = ()

    def _join(self, parts: list[str]) -> str:
        return parts[0] if len(parts) == 1 else "".join(parts)

    def __getitem__(self, i: slice) -> str:
        if not isinstance(i, slice) or i.step not in (None, 1):
            raise TypeError("Rope supports only contiguous slices")
        a, b, _ = i.indices(self.n)
        return self._slice(a, b)

    def __str__(self) -> str:
        return self._slice(0, self.n)

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other)

    __hash__ = None  # type: ignore[assignment]

    def endswith(self, suffix: str, start: int = 0, end: int | None = None) -> bool:
        """`str.endswith` semantics for the text[start:end]."""
        end = self.n if end is None else min(end, self.n)
        a = end - len(suffix)
        return a >= start and self._slice(a, end) == suffix
