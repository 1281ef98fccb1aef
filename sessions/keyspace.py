"""The sessions keyspace: every key this package reads or writes, in one place.

All keys are FoundationDB tuple-encoded under ``root["s"]`` where ``root`` is the
deployment's :class:`kv.Subspace` (default ``(b"surefoot",)``), so several
deployments can share one cluster. ``T`` below is the owner tag
(``"realm/subject"``); owned records live under ``("o", T, ...)`` so one owner's
data is one contiguous range, and every owned value also stores ``"owner": T``
which readers check again.

Key (under root["s"])                       Value
------------------------------------------  ---------------------------------------------
("o", T, "cv", conv)                        CBOR {"owner": T}: the conversation exists for T.
                                            Older layout, read only: written by the first
                                            journal emit and by ensure_conversation_tr until
                                            session 17; now the "n" key below says it (a
                                            journal read finding neither is NotFound)
("o", T, "jn", conv, "e", <versionstamp>)   CBOR [type, data, ts, eid]: one journal event
                                            (eid: null, or the id a guarded writer looks for);
                                            the 12-byte versionstamp (10 commit + 2
                                            per-transaction order) *is* the event's position
("o", T, "jn", conv, "n")                   int64 LE: events ever emitted (atomic add; watched
                                            by followers; never decreases, so no ABA; never
                                            cleared). Its existence is the conversation's:
                                            every emit adds to it, ensure_conversation_tr adds 0
("o", T, "jn", conv, "t")                   int64 LE: events ever trimmed (atomic add, trimmers)
("o", T, "jn", conv, "w")                   12 bytes: position of the last trimmed event (the
                                            retention watermark; cursors <= it fell behind)
("o", T, "ss", sid, "h")                    CBOR head {"owner", "n", "base", "seg", "tok",
                                            "staging", "mark"}: message count, fork segments,
                                            last append token, where a reader of the recent
                                            history starts (Transcripts.read_tail_tr; the
                                            loop's latest compaction cut); absent = no session
("o", T, "ss", sid, "meta")                 CBOR metadata {"owner", "id", "created", "project",
                                            "parent", "fork_at", "title", "extra"}: older
                                            layout, read only (sessions created before session
                                            17; their "sl" value is empty)
("o", T, "ss", sid, "m", seq, chunk)        bytes: chunk ``chunk`` of message ``seq``'s CBOR
("o", T, "sl", sid)                         the session listing index for the owner; its value
                                            is the session's CBOR metadata (as "meta" above;
                                            b"" for a session of the older layout)
("o", T, "pj", pid)                         CBOR project {"owner", "id", "name", "created",
                                            "agents": {agent_name: overrides}}
("o", T, "pm", pid, sid)                    b"": session ``sid`` belongs to project ``pid``
("o", T, "at", aid)                         CBOR attachment {"owner", "id", "state", "size",
                                            "media_type", "filename", "sha256", "chunks",
                                            "created"}
("o", T, "ac", aid, i)                      bytes: attachment chunk i
("ap", created_us, T, aid)                  b"": pending-attachment index (cleanup of
                                            uploads a crash abandoned)
("fs", created_us, T, sid)                  b"": staging-fork index (cleanup of copy-forks
                                            a crash abandoned)
"""

from __future__ import annotations

from functools import lru_cache

import kv

from .codec import fastpack, pack_str

#: Packed keys are pure functions of their parts; tuple packing costs tens of
#: microseconds, so hot keys (a conversation's journal, a run's lease) are cached.
#: Small: the hot keys are those of runs in flight, and every entry is objects the
#: cycle collector scans on each full collection (8,192 entries per cache, ~20
#: caches, made those collections ~1.7x as long in the turns benchmark).
_CACHE = 1_024

__all__ = ["SessionsKeyspace", "DEFAULT_ROOT", "default_root"]

# Packed constant parts: a hot key is a cached packed prefix + its variable parts (tuple
# encoding concatenates), so building one encodes only what varies.
_O, _CV, _JN, _E, _N, _T, _W = (pack_str(p) for p in ("o", "cv", "jn", "e", "n", "t", "w"))
_SS, _HD, _META, _M, _SL = (pack_str(p) for p in ("ss", "h", "meta", "m", "sl"))

#: The default deployment root: ``kv.Subspace((b"surefoot",))``.
DEFAULT_ROOT = (b"surefoot",)


def default_root() -> "kv.Subspace":
    return kv.Subspace(DEFAULT_ROOT)


class SessionsKeyspace:
    """Key constructors for the table above. Pure; no I/O."""

    __slots__ = ("root", "base", "_b")

    def __init__(self, root: "kv.Subspace | None" = None) -> None:
        self.root = root if root is not None else default_root()
        self.base = self.root["s"]
        self._b = self.base.key()

    def _sub(self, t: tuple) -> "kv.Subspace":
        # Tuple encoding concatenates, so a raw prefix of the packed tuple is the
        # same subspace as chaining ``base[a][b]...``, built once.
        return kv.Subspace(raw_prefix=fastpack(self._b, t))

    # -- owners -------------------------------------------------------------
    @lru_cache(maxsize=_CACHE)
    def owner_range(self, tag: str) -> slice:
        return self.base.range(("o", tag))

    @lru_cache(maxsize=_CACHE)
    def _owned(self, tag: str) -> bytes:
        """The packed ``("o", T)`` prefix of an owner's keys."""
        return self._b + _O + pack_str(tag)

    @lru_cache(maxsize=_CACHE)
    def _journal(self, tag: str, conv: str) -> bytes:
        """The packed ``("o", T, "jn", conv)`` prefix of a conversation's journal keys."""
        return self._owned(tag) + _JN + pack_str(conv)

    @lru_cache(maxsize=_CACHE)
    def _session(self, tag: str, sid: str) -> bytes:
        """The packed ``("o", T, "ss", sid)`` prefix of a session's keys."""
        return self._owned(tag) + _SS + pack_str(sid)

    # -- conversations and journal -----------------------------------------
    @lru_cache(maxsize=_CACHE)
    def conversation(self, tag: str, conv: str) -> bytes:
        return self._owned(tag) + _CV + pack_str(conv)

    @lru_cache(maxsize=_CACHE)
    def conversations_range(self, tag: str) -> slice:
        return self.base.range(("o", tag, "cv"))

    @lru_cache(maxsize=_CACHE)
    def events(self, tag: str, conv: str) -> "kv.Subspace":
        """Subspace of the journal's events; keys are ``(<versionstamp>,)`` inside it."""
        return kv.Subspace(raw_prefix=self._journal(tag, conv) + _E)

    @lru_cache(maxsize=_CACHE)
    def emitted(self, tag: str, conv: str) -> bytes:
        return self._journal(tag, conv) + _N

    @lru_cache(maxsize=_CACHE)
    def trimmed(self, tag: str, conv: str) -> bytes:
        return self._journal(tag, conv) + _T

    @lru_cache(maxsize=_CACHE)
    def watermark(self, tag: str, conv: str) -> bytes:
        return self._journal(tag, conv) + _W

    # -- sessions (transcripts) --------------------------------------------
    @lru_cache(maxsize=_CACHE)
    def head(self, tag: str, sid: str) -> bytes:
        return self._session(tag, sid) + _HD

    @lru_cache(maxsize=_CACHE)
    def meta(self, tag: str, sid: str) -> bytes:
        return self._session(tag, sid) + _META

    @lru_cache(maxsize=_CACHE)
    def messages(self, tag: str, sid: str) -> "kv.Subspace":
        """Subspace of message chunks: keys ``(seq, chunk)``."""
        return kv.Subspace(raw_prefix=self._session(tag, sid) + _M)

    def head_and_messages(self, tag: str, sid: str) -> tuple[bytes, bytes]:
        """``(head(tag, sid), messages(tag, sid).raw_prefix)``, made from the session prefix
        and not cached: what an append writes, which Transcripts remembers per session itself
        (a turn's session is new: two cache misses, a Subspace and two evictions a turn, before)."""
        session = self._session(tag, sid)
        return session + _HD, session + _M

    @lru_cache(maxsize=_CACHE)
    def session_range(self, tag: str, sid: str) -> slice:
        return self.base.range(("o", tag, "ss", sid))

    @lru_cache(maxsize=_CACHE)
    def session_listing(self, tag: str, sid: str) -> bytes:
        return self._owned(tag) + _SL + pack_str(sid)

    @lru_cache(maxsize=_CACHE)
    def session_listing_range(self, tag: str) -> slice:
        return self.base.range(("o", tag, "sl"))

    @lru_cache(maxsize=_CACHE)
    def staging_fork(self, created_us: int, tag: str, sid: str) -> bytes:
        return fastpack(self._b, ("fs", created_us, tag, sid))

    def staging_forks_range(self) -> slice:
        return self.base.range(("fs",))

    # -- projects -----------------------------------------------------------
    @lru_cache(maxsize=_CACHE)
    def project(self, tag: str, pid: str) -> bytes:
        return fastpack(self._b, ("o", tag, "pj", pid))

    @lru_cache(maxsize=_CACHE)
    def projects_range(self, tag: str) -> slice:
        return self.base.range(("o", tag, "pj"))

    @lru_cache(maxsize=_CACHE)
    def project_member(self, tag: str, pid: str, sid: str) -> bytes:
        return fastpack(self._b, ("o", tag, "pm", pid, sid))

    @lru_cache(maxsize=_CACHE)
    def project_members_range(self, tag: str, pid: str) -> slice:
        return self.base.range(("o", tag, "pm", pid))

    # -- attachments --------------------------------------------------------
    @lru_cache(maxsize=_CACHE)
    def attachment(self, tag: str, aid: str) -> bytes:
        return fastpack(self._b, ("o", tag, "at", aid))

    @lru_cache(maxsize=_CACHE)
    def attachment_chunks(self, tag: str, aid: str) -> "kv.Subspace":
        return self._sub(("o", tag, "ac", aid))

    @lru_cache(maxsize=_CACHE)
    def attachments_range(self, tag: str) -> slice:
        return self.base.range(("o", tag, "at"))

    @lru_cache(maxsize=_CACHE)
    def pending_attachment(self, created_us: int, tag: str, aid: str) -> bytes:
        return fastpack(self._b, ("ap", created_us, tag, aid))

    def pending_attachments_range(self) -> slice:
        return self.base.range(("ap",))
