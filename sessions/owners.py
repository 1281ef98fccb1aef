"""Owners: who a record belongs to.

An owner is a principal ``(realm, subject)`` taken from a verified credential
(never from a request body). Its *tag* is ``"realm/subject"``; because neither
part may contain ``/``, the tag parses back unambiguously and two different
principals can never produce the same tag (``("a/b", "c")`` vs ``("a", "b/c")``
is exactly the collision the refusal prevents).

Every owned record is stored under its owner's key prefix *and* carries the tag
in its value; readers check the stored tag again, so a key-construction bug can
never hand one owner another's record. Foreign == missing: the same
:class:`~sessions.errors.NotFound`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

from .errors import InvalidOwner

__all__ = ["Owner", "OwnerLike", "owner_tag", "as_tag", "parse_tag", "LOCAL_OWNER", "MAX_OWNER_PART"]

#: Longest realm or subject accepted (keys carry the tag; FDB keys are <= 10,000 bytes).
MAX_OWNER_PART = 256
assert MAX_OWNER_PART * 2 + 1 < 1_000


def _check_part(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidOwner(f"owner {name} must be a string")
    if not value:
        raise InvalidOwner(f"owner {name} must not be empty")
    if "/" in value:
        raise InvalidOwner(f"owner {name} must not contain '/'")
    if len(value) > MAX_OWNER_PART:
        raise InvalidOwner(f"owner {name} longer than {MAX_OWNER_PART} characters")
    if any(ord(c) < 0x20 for c in value):
        raise InvalidOwner(f"owner {name} must not contain control characters")
    return value


@dataclass(frozen=True)
class Owner:
    """A principal. Construct with ``Owner(realm, subject)``; validation is immediate."""

    # Slots written out rather than ``slots=True``, so that the tag made once in __post_init__
    # is a slot and not a dataclass field: fields, asdict, equality, hashing and repr see
    # realm and subject only, as before. as_tag asks for the tag on every request (a submit's
    # checks), and the f-string cost as much as the rest of it.
    __slots__ = ("realm", "subject", "_tag")

    realm: str
    subject: str

    def __post_init__(self) -> None:
        _check_part("realm", self.realm)
        _check_part("subject", self.subject)
        object.__setattr__(self, "_tag", f"{self.realm}/{self.subject}")

    # (pickle and copy: frozen, so the state goes back through object.__setattr__, as
    # ``slots=True`` would have arranged; the tag is made again from the parts)
    def __getstate__(self) -> tuple[str, str]:
        return (self.realm, self.subject)

    def __setstate__(self, state: tuple[str, str]) -> None:
        realm, subject = state
        object.__setattr__(self, "realm", realm)
        object.__setattr__(self, "subject", subject)
        object.__setattr__(self, "_tag", f"{realm}/{subject}")

    @property
    def tag(self) -> str:
        return self._tag

    @classmethod
    def from_tag(cls, tag: str) -> "Owner":
        return parse_tag(tag)

    def __str__(self) -> str:
        return self.tag


OwnerLike = Union[Owner, str]

#: The owner of everything in the single-user embedded profile.
LOCAL_OWNER = Owner("local", "default")


def owner_tag(realm: str, subject: str) -> str:
    """The tag of ``(realm, subject)``; raises :class:`InvalidOwner` for ``/`` or empty parts."""
    return Owner(realm, subject).tag


def parse_tag(tag: str) -> Owner:
    if not isinstance(tag, str) or tag.count("/") != 1:
        raise InvalidOwner("an owner tag is 'realm/subject' with exactly one '/'")
    realm, subject = tag.split("/")
    return Owner(realm, subject)


#: Validated tags remembered by :func:`as_tag` (every keyspace call normalises its
#: owner, a dozen times per agent turn, always the same few tags).
TAG_CACHE_SIZE = 4_096
assert TAG_CACHE_SIZE > 0


@functools.lru_cache(maxsize=TAG_CACHE_SIZE)
def _valid_tag(tag: str) -> str:
    # Validation is a pure function of the string, so a remembered success is as good
    # as re-checking; failures raise and are not cached (lru_cache caches returns only).
    return parse_tag(tag).tag


def as_tag(owner: OwnerLike) -> str:
    """Normalise an :class:`Owner` or a tag string to a validated tag."""
    if type(owner) is str:
        return _valid_tag(owner)
    if isinstance(owner, Owner):
        return owner._tag  # (the attribute, not the property: one call less)
    return parse_tag(owner).tag
