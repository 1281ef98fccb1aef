"""Attachments: pending -> ready -> deleting, chunked under the value limit.

An upload is ``begin`` (a *pending* record, indexed for cleanup), any number
of ``write_chunk`` transactions, and ``finish``, which checks that every chunk
is present, the size is within the cap (192 KiB decoded) and the SHA-256
matches, then flips the record to *ready* in the same transaction. A crash
anywhere before ``finish`` leaves a pending record that
:meth:`Attachments.cleanup_pending` removes later; a ready record always has
all its chunks. Deleting marks *deleting* first (no longer readable), then
clears chunks and record.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import kv

from .codec import dumps, loads
from .errors import InvalidState, NotFound, TooLarge
from .keyspace import SessionsKeyspace
from .owners import OwnerLike, as_tag
from .transcript import check_session_id

__all__ = ["Attachments", "AttachmentInfo", "MAX_ATTACHMENT_BYTES", "ATTACHMENT_CHUNK",
           "PENDING", "READY", "DELETING", "decode_base64"]

#: Decoded size cap.
MAX_ATTACHMENT_BYTES = 192 * 1024
#: Chunk size (each chunk one kv value).
ATTACHMENT_CHUNK = 64 * 1024
assert ATTACHMENT_CHUNK < kv.limits.VALUE_SIZE_LIMIT
MAX_CHUNKS = -(-MAX_ATTACHMENT_BYTES // ATTACHMENT_CHUNK)
PENDING, READY, DELETING = "pending", "ready", "deleting"


@dataclass(frozen=True, slots=True)
class AttachmentInfo:
    id: str
    owner: str
    state: str
    media_type: str
    filename: str | None
    size: int | None
    sha256: str | None
    created: float


def decode_base64(data: str) -> bytes:
    """Decode base64, refusing (TooLarge) anything over the cap before decoding it all."""
    if len(data) > (MAX_ATTACHMENT_BYTES * 4) // 3 + 8:
        raise TooLarge(f"attachment larger than {MAX_ATTACHMENT_BYTES} bytes")
    try:
        out = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("attachment data is not valid base64") from None
    if len(out) > MAX_ATTACHMENT_BYTES:
        raise TooLarge(f"attachment of {len(out)} bytes exceeds {MAX_ATTACHMENT_BYTES}")
    return out


def _info(rec: dict[str, Any]) -> AttachmentInfo:
    return AttachmentInfo(rec["id"], rec["owner"], rec["state"], rec["media_type"], rec.get("filename"),
                          rec.get("size"), rec.get("sha256"), rec["created"])


class Attachments:
    def __init__(self, db: Any, root: "kv.Subspace | None" = None, *, clock: Callable[[], float] = time.time,
                 new_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self.db = db
        self.keys = SessionsKeyspace(root)
        self.clock = clock
        self.new_id = new_id

    async def _get(self, tr: Any, tag: str, aid: str) -> dict[str, Any]:
        raw = await tr.get(self.keys.attachment(tag, aid))
        rec = loads(raw) if raw is not None else None
        if rec is None or rec.get("owner") != tag:
            raise NotFound(f"attachment {aid!r} not found")
        return rec

    async def begin(self, owner: OwnerLike, *, media_type: str, filename: str | None = None,
                    sha256: str | None = None, attachment_id: str | None = None) -> AttachmentInfo:
        """Create a pending attachment. Guarded: an existing record with this id is returned."""
        tag = as_tag(owner)
        aid = check_session_id(attachment_id or self.new_id())
        now = self.clock()
        created_us = int(now * 1e6)
        rec = {"owner": tag, "id": aid, "state": PENDING, "media_type": media_type, "filename": filename,
               "size": None, "sha256": sha256, "chunks": None, "created": now, "created_us": created_us}

        async def fn(tr: Any) -> AttachmentInfo:  # guarded: reads the record first; an existing one is returned
            try:
                return _info(await self._get(tr, tag, aid))
            except NotFound:
                tr.set(self.keys.attachment(tag, aid), dumps(rec))
                tr.set(self.keys.pending_attachment(created_us, tag, aid), b"")
                return _info(rec)

        return await self.db.transact(fn)

    async def write_chunk(self, owner: OwnerLike, attachment_id: str, index: int, data: bytes) -> None:
        """Write chunk ``index`` (every chunk but the last is exactly ATTACHMENT_CHUNK bytes).
        Idempotent: the same bytes land on the same key; only a pending upload accepts chunks."""
        tag = as_tag(owner)
        if not 0 <= index < MAX_CHUNKS:
            raise TooLarge(f"attachment larger than {MAX_ATTACHMENT_BYTES} bytes")
        if len(data) > ATTACHMENT_CHUNK:
            raise ValueError(f"a chunk is at most {ATTACHMENT_CHUNK} bytes")

        async def fn(tr: Any) -> None:  # idempotent: the same bytes on the same key (state-checked)
            rec = await self._get(tr, tag, attachment_id)
            if rec["state"] != PENDING:
                raise InvalidState(f"attachment {attachment_id!r} is {rec['state']}, not pending")
            tr.set(self.keys.attachment_chunks(tag, attachment_id).pack((index,)), bytes(data))

        await self.db.transact(fn)

    async def finish(self, owner: OwnerLike, attachment_id: str) -> AttachmentInfo:
        """Verify every chunk and make the attachment ready, in one transaction.
        Idempotent: a ready attachment is returned as is."""
        tag = as_tag(owner)

        async def fn(tr: Any) -> AttachmentInfo:  # guarded: a ready record is returned as is
            rec = await self._get(tr, tag, attachment_id)
            if rec["state"] == READY:
                return _info(rec)
            if rec["state"] != PENDING:
                raise InvalidState(f"attachment {attachment_id!r} is {rec['state']}")
            sub = self.keys.attachment_chunks(tag, attachment_id)
            r = sub.range()
            rows = await tr.get_range(r.start, r.stop)
            indices = [sub.unpack(row.key)[0] for row in rows]
            if indices != list(range(len(rows))) or not rows:
                raise InvalidState(f"attachment {attachment_id!r} is missing chunks")
            if any(len(row.value) != ATTACHMENT_CHUNK for row in rows[:-1]):
                raise InvalidState(f"attachment {attachment_id!r} has a short chunk before the last")
            h = hashlib.sha256()
            size = 0
            for row in rows:
                h.update(row.value)
                size += len(row.value)
            if size > MAX_ATTACHMENT_BYTES:
                raise TooLarge(f"attachment of {size} bytes exceeds {MAX_ATTACHMENT_BYTES}")
            digest = h.hexdigest()
            if rec.get("sha256") and rec["sha256"] != digest:
                raise InvalidState(f"attachment {attachment_id!r} does not match its declared SHA-256")
            rec.update(state=READY, size=size, sha256=digest, chunks=len(rows))
            tr.set(self.keys.attachment(tag, attachment_id), dumps(rec))
            tr.clear(self.keys.pending_attachment(rec["created_us"], tag, attachment_id))
            return _info(rec)

        return await self.db.transact(fn)

    async def upload(self, owner: OwnerLike, data: bytes | str, *, media_type: str,
                     filename: str | None = None, attachment_id: str | None = None) -> AttachmentInfo:
        """begin + chunks + finish. ``data`` may be base64 text (decoded, capped)."""
        raw = decode_base64(data) if isinstance(data, str) else bytes(data)
        if len(raw) > MAX_ATTACHMENT_BYTES:
            raise TooLarge(f"attachment of {len(raw)} bytes exceeds {MAX_ATTACHMENT_BYTES}")
        info = await self.begin(owner, media_type=media_type, filename=filename,
                                sha256=hashlib.sha256(raw).hexdigest(), attachment_id=attachment_id)
        if info.state == READY:
            return info
        for i in range(0, max(1, len(raw)), ATTACHMENT_CHUNK):
            await self.write_chunk(owner, info.id, i // ATTACHMENT_CHUNK, raw[i:i + ATTACHMENT_CHUNK])
        return await self.finish(owner, info.id)

    async def get(self, owner: OwnerLike, attachment_id: str) -> AttachmentInfo:
        tag = as_tag(owner)
        return await self.db.transact(lambda tr: self._info_tr(tr, tag, attachment_id))  # read-only

    async def _info_tr(self, tr: Any, tag: str, aid: str) -> AttachmentInfo:
        return _info(await self._get(tr, tag, aid))

    async def read(self, owner: OwnerLike, attachment_id: str) -> bytes:
        """The bytes of a ready attachment (InvalidState while pending or deleting). Read-only."""
        tag = as_tag(owner)

        async def fn(tr: Any) -> bytes:  # read-only
            rec = await self._get(tr, tag, attachment_id)
            if rec["state"] != READY:
                raise InvalidState(f"attachment {attachment_id!r} is {rec['state']}")
            r = self.keys.attachment_chunks(tag, attachment_id).range()
            rows = await tr.get_range(r.start, r.stop)
            if len(rows) != rec["chunks"]:
                raise InvalidState(f"attachment {attachment_id!r} is damaged")
            return b"".join(row.value for row in rows)

        return await self.db.transact(fn)

    async def delete(self, owner: OwnerLike, attachment_id: str) -> None:
        """Mark deleting, then clear. Idempotent per step; NotFound once gone."""
        tag = as_tag(owner)

        async def mark(tr: Any) -> dict[str, Any]:  # idempotent: marks deleting (state-checked)
            rec = await self._get(tr, tag, attachment_id)
            if rec["state"] != DELETING:
                rec["state"] = DELETING
                tr.set(self.keys.attachment(tag, attachment_id), dumps(rec))
            return rec

        rec = await self.db.transact(mark)
        # idempotent: clears
        await self.db.transact(lambda tr: self._purge_tr(tr, tag, attachment_id, rec.get("created_us")))

    async def _purge_tr(self, tr: Any, tag: str, aid: str, created_us: int | None) -> None:
        r = self.keys.attachment_chunks(tag, aid).range()
        tr.clear_range(r.start, r.stop)
        tr.clear(self.keys.attachment(tag, aid))
        if created_us is not None:
            tr.clear(self.keys.pending_attachment(created_us, tag, aid))

    async def cleanup_pending(self, older_than: float = 3600.0) -> int:
        """Remove uploads left pending for longer than ``older_than`` seconds (a crash
        mid-upload). Guarded: each entry's record is re-read and only a pending one removed."""
        cutoff = int((self.clock() - older_than) * 1e6)
        removed = 0
        while True:
            async def fn(tr: Any) -> tuple[int, int]:  # guarded: re-reads each record; only pending ones are purged
                r = self.keys.pending_attachments_range()
                rows = await tr.get_range(r.start, self.keys.pending_attachment(cutoff, "", ""), limit=50)
                n = 0
                for row in rows:
                    _ap, created_us, tag, aid = kv.tuple.unpack(row.key[len(self.keys.base.key()):])
                    raw = await tr.get(self.keys.attachment(tag, aid))
                    if raw is not None and loads(raw).get("state") == PENDING:
                        await self._purge_tr(tr, tag, aid, created_us)
                        n += 1
                    tr.clear(row.key)
                return len(rows), n

            seen, n = await self.db.transact(fn)
            removed += n
            if seen == 0:
                return removed
