"""FoundationDB key selectors: "the last key < (or <=) this key, then move offset keys"."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KeySelector"]


@dataclass(frozen=True, slots=True)
class KeySelector:
    key: bytes
    or_equal: bool
    offset: int

    @classmethod
    def last_less_than(cls, key: bytes) -> "KeySelector":
        return cls(key, False, 0)

    @classmethod
    def last_less_or_equal(cls, key: bytes) -> "KeySelector":
        return cls(key, True, 0)

    @classmethod
    def first_greater_than(cls, key: bytes) -> "KeySelector":
        return cls(key, True, 1)

    @classmethod
    def first_greater_or_equal(cls, key: bytes) -> "KeySelector":
        return cls(key, False, 1)

    def __add__(self, offset: int) -> "KeySelector":
        return KeySelector(self.key, self.or_equal, self.offset + offset)

    def __sub__(self, offset: int) -> "KeySelector":
        return KeySelector(self.key, self.or_equal, self.offset - offset)
