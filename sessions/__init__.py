"""sessions — transcripts, the event journal, owners, projects and attachments.

Built on ``kv`` only (runs unchanged on memory, lmdb and FoundationDB). Keys:
sessions/keyspace.py. Values: CBOR. Every transaction is idempotent or
guarded, and says which.

Public face::

    from sessions import Sessions, Owner, events
    s = Sessions(db, root=kv.Subspace((b"surefoot",)))     # root optional
    owner = Owner("realm", "subject")                      # refuses "/" (InvalidOwner)

Composition in one transaction (the loop's pattern: a state change and the
event describing it commit together, both behind the lease check)::

    async def step(tr):
        await ledger.check_lease(tr, lease)                           # LeaseLost
        head = await s.transcripts.append_tr(tr, owner, conv, [msg], expected_head=n)
        ref = await s.journal.emit(tr, owner, conv, events.MESSAGE_ADDED, {"seq": n})
        return ref                                  # return refs from fn (retries!)
    ref = await db.transact(step)
    cursor = await ref.cursor()   # opaque str, identical in replay and live

Several ``emit`` calls in one transaction get distinct positions in call
order. Convenience methods run their own (guarded) transaction:
``journal.emit_one/emit_many``, ``transcripts.append``.

Journal::

    page = await s.journal.read(owner, conv, after=cursor, limit=256)   # O(page)
    page.events            # [Event(cursor, type, data, ts)]
    page.next_cursor       # resume after this page
    page.behind            # True: cursor fell behind retention ...
    page.first_retained    # ... and this is where the journal now starts
    async for e in s.journal.follow(owner, conv, after=cursor):  # replay, then live
        ...                # CursorBehind(first_retained) if behind (on_behind="continue" skips)
    co = Coalescer(s.journal, owner, conv, guard=lambda tr: ledger.check_lease(tr, lease))
    await co.add({"part": 0, "delta": "tok"})   # part.updated, merged and flushed in batches
    await co.flush()                             # at the end of the stream

Journal event values must be <= 90 KB (TooLarge); put big payloads in the
transcript. Retention: 20,000 events per conversation by default (0 keeps
all), trimmed by ``journal.trim`` / ``maybe_trim`` / the ``run_trimmer``
service task, never blocking appends.

Transcripts: ``create``, ``append(_tr)(owner, sid, [dict, ...], expected_head=)``
(SessionConflict on a moved head; TooLarge before writing past the
transaction limit), ``read(owner, sid, start, limit)`` -> TranscriptPage,
``fork(owner, sid, at)`` (by reference, O(1), atomic; copy with a staging
sentinel when the chain is too deep or ``by_reference=False``).

Projects: ``projects.create/get/list/rename/delete``, ``set_agent_overrides(owner,
project, agent, overrides)``; apply with ``render_agent_config(base, overrides)``
(a new dict; shared definitions are never written).

Attachments: ``attachments.upload(owner, bytes_or_base64, media_type=)`` or
``begin`` / ``write_chunk`` / ``finish``; ``read``, ``delete``,
``cleanup_pending``. Pending -> ready -> deleting, 192 KiB decoded cap.

Owners: everything is stored under ``("o", owner_tag, ...)`` and stores its
tag; a foreign record raises the same :class:`NotFound` with the same message
as a missing one.
"""

from __future__ import annotations

from typing import Any, Callable

import time

from . import events
from .coalesce import Coalescer
from .errors import (CursorBehind, InvalidCursor, InvalidOwner, InvalidState, NotFound, SessionConflict,
                     SessionError, TooLarge)
from .journal import DEFAULT_RETENTION, Event, EventRef, Journal, JournalPage
from .keyspace import DEFAULT_ROOT, SessionsKeyspace, default_root
from .owners import LOCAL_OWNER, Owner, OwnerLike, as_tag, owner_tag, parse_tag
from .transcript import Message, SessionInfo, TranscriptPage, Transcripts
from .projects import ProjectInfo, Projects, render_agent_config
from .attachments import MAX_ATTACHMENT_BYTES, AttachmentInfo, Attachments

__all__ = [
    "Sessions", "events", "Coalescer",
    "SessionError", "NotFound", "SessionConflict", "InvalidOwner", "InvalidCursor", "CursorBehind", "TooLarge",
    "InvalidState",
    "Journal", "Event", "EventRef", "JournalPage", "DEFAULT_RETENTION",
    "Transcripts", "Message", "TranscriptPage", "SessionInfo",
    "Owner", "OwnerLike", "LOCAL_OWNER", "owner_tag", "as_tag", "parse_tag",
    "SessionsKeyspace", "DEFAULT_ROOT", "default_root",
    "Projects", "ProjectInfo", "render_agent_config", "Attachments", "AttachmentInfo", "MAX_ATTACHMENT_BYTES",
]


class Sessions:
    """The sessions layer of one deployment root: ``.journal``, ``.transcripts``,
    ``.projects``, ``.attachments``."""

    def __init__(self, db: Any, root: Any = None, *, retention: int = DEFAULT_RETENTION,
                 clock: Callable[[], float] = time.time, new_id: Callable[[], str] | None = None) -> None:
        import uuid

        self.db = db
        self.root = root if root is not None else default_root()
        ids = new_id or (lambda: uuid.uuid4().hex)
        self.journal = Journal(db, self.root, retention=retention, clock=clock,
                               **({"new_id": new_id} if new_id else {}))
        self.transcripts = Transcripts(db, self.root, clock=clock, new_id=ids)
        self.projects = Projects(db, self.root, clock=clock, new_id=ids)
        self.attachments = Attachments(db, self.root, clock=clock, new_id=ids)
