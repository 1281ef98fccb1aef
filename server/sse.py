"""Server-sent events: framing, and one shared journal follower per conversation.

Framing
    Each journal event becomes one SSE frame whose ``id`` is the event's journal
    position (its cursor), whose ``event`` is the event type and whose ``data``
    is the JSON event. A client that reconnects sends ``Last-Event-ID`` and gets
    everything after it: replayed positions equal live ones because both come
    from the same journal keys. Heartbeats are SSE comments, which EventSource
    ignores and proxies count as traffic.

Fan-out (:class:`Hubs`)
    A thousand followers of one conversation must not cost a thousand journal
    reads per event. Per (owner, conversation) one :class:`Hub` task follows the
    journal from its tail and hands every event, encoded once, to each
    subscriber's bounded queue. A subscriber joins the hub *before* replaying
    and replays only after the hub has read its starting tail, so every event is
    either at or before that tail (the replay, read later, sees it) or after it
    (the hub delivers it): no gap. Live frames at or before the last replayed
    position are dropped: no duplicate. Positions are fixed-width hex, so string
    order is journal order.

    A subscriber whose queue fills (a client not reading) is cut off rather than
    buffered without bound; it reconnects with Last-Event-ID and loses nothing.

Direct writes
    Once a subscriber's stream is live, caught up and has nothing pending, and its
    front gave it a :class:`~server.wire.DirectWriter` (hypercorn's HTTP/1.1 over plain
    TCP), the hub writes each frame — pre-framed as one HTTP/1.1 chunk, built once per
    event — to that subscriber's socket itself: no queue, no task switch, no ASGI send
    per follower (at 1,000 followers this took the fan-out from ~175 to ~22 ms of CPU
    per event). A write the kernel takes only in part leaves its rest pending in the
    writer, and the hub hands the subscriber back to its own task, which flushes it,
    drains what queued meanwhile, and goes direct again once caught up. The duplicate
    check (``Subscriber.last``) is the same on both paths.

Heartbeats
    The hub, not each connection, keeps time: when its journal has been quiet for
    half a heartbeat period it queues one heartbeat comment to every subscriber, so
    no stream is silent for much longer than :data:`HEARTBEAT_SECONDS`. A timeout per
    connection would cost a cancel scope per frame per connection — measurable at a
    thousand followers, where the per-frame path is the whole cost.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from .wire import DirectWriter, chunk

log = logging.getLogger(__name__)

__all__ = [
    "encode_event", "encode_comment", "encode_named", "Hubs", "Hub", "Subscriber",
    "HEARTBEAT_SECONDS", "SUBSCRIBER_QUEUE", "BEHIND_EVENT", "REPLAY_PAGE", "EventStream", "Frame", "stream",
]

#: Seconds of silence after which a heartbeat comment is sent.
HEARTBEAT_SECONDS = 15.0
#: Frames buffered per subscriber before a non-reading client is cut off.
SUBSCRIBER_QUEUE = 4_096
#: Most frames written to one connection in one chunk.
MAX_BATCH_FRAMES = 256
#: Journal page size while replaying.
REPLAY_PAGE = 512
#: How long a hub with no subscribers keeps following (reconnects are common).
HUB_LINGER_SECONDS = 5.0
#: The SSE event telling a client its cursor fell behind retention.
BEHIND_EVENT = "cursor.behind"
#: Sent before the server closes streams for shutdown.
CLOSING_EVENT = "stream.closing"
assert HEARTBEAT_SECONDS > 0 and SUBSCRIBER_QUEUE > 0 and REPLAY_PAGE > 0

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=str)


def event_json(ev: Any) -> dict[str, Any]:
    return {"cursor": ev.cursor, "type": ev.type, "data": ev.data, "ts": ev.ts}


def encode_event(ev: Any) -> bytes:
    """One journal event as an SSE frame (id = position, event = type, data = JSON)."""
    data = _JSON.encode(event_json(ev))
    # JSON never contains a raw newline, so one data line is always enough.
    return f"id: {ev.cursor}\nevent: {ev.type}\ndata: {data}\n\n".encode()


def encode_named(name: str, data: Any) -> bytes:
    """A frame with no id (it must not move the client's Last-Event-ID)."""
    return f"event: {name}\ndata: {_JSON.encode(data)}\n\n".encode()


def encode_comment(text: str = "") -> bytes:
    return f": {text}\n\n".encode()


class Frame:
    """One encoded SSE frame as the hub broadcasts it: built once per event, shared by every subscriber.

    ``position`` is the event's cursor (None for a heartbeat); ``data`` the SSE bytes; ``chunk``
    the same bytes framed as one HTTP/1.1 chunk for the direct write path, also built once.
    """

    __slots__ = ("position", "data", "_chunk")

    def __init__(self, position: str | None, data: bytes) -> None:
        self.position = position
        self.data = data
        self._chunk: bytes | None = None

    @property
    def chunk(self) -> bytes:
        if self._chunk is None:
            self._chunk = chunk(self.data)
        return self._chunk


HEARTBEAT_FRAME = encode_comment("heartbeat")
_HEARTBEAT = Frame(None, HEARTBEAT_FRAME)
#: Queued to a subscriber whose direct write came up short: "flush your writer" (carries no frame).
_FLUSH = Frame(None, b"")


@dataclass(eq=False)
class Subscriber:
    send: trio.MemorySendChannel
    receive: trio.MemoryReceiveChannel
    overflowed: bool = False
    #: Set by the subscriber's own stream while it is live, caught up and has nothing pending:
    #: the hub then writes frames to the connection itself instead of queueing them.
    direct: DirectWriter | None = None
    #: The newest position sent to this subscriber (replayed, queued-and-written or written
    #: directly): live frames at or before it are duplicates of the replay and are dropped.
    last: str | None = None


class Hub:
    """Follows one conversation's journal from its tail; broadcasts encoded frames."""

    def __init__(self, key: tuple[str, str], follow: Callable[[str | None], AsyncIterator[Any]],
                 tail: Callable[[], Awaitable[str | None]], on_exit: Callable[["Hub"], None],
                 heartbeat: float = HEARTBEAT_SECONDS) -> None:
        assert heartbeat > 0
        self.key = key
        self.heartbeat = heartbeat
        self._quiet = True  # no event since the last heartbeat tick
        self._follow = follow
        self._tail = tail
        self._on_exit = on_exit
        self.subscribers: set[Subscriber] = set()
        self.started = trio.Event()  # set once the starting tail is read
        self.failed: BaseException | None = None
        self._empty_since: float | None = None
        self._cancel = trio.CancelScope()
        self.delivered = 0
        #: Direct writes that came up short and handed the rest to the subscriber's task (a slow reader).
        self.handoffs = 0
        self.done = False  # set (synchronously) when run() ends; a done hub takes no subscribers

    def subscribe(self) -> Subscriber:
        send, receive = trio.open_memory_channel[Frame](SUBSCRIBER_QUEUE)
        sub = Subscriber(send, receive)
        self.subscribers.add(sub)
        self._empty_since = None
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        sub.direct = None
        sub.send.close()
        if not self.subscribers:
            self._empty_since = trio.current_time()

    def close(self) -> None:
        self._cancel.cancel()

    async def run(self) -> None:
        try:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._linger_watch, nursery.cancel_scope)
                    nursery.start_soon(self._heartbeats)
                    tail = await self._tail()
                    self.started.set()
                    async for ev in self._follow(tail):
                        self._broadcast(Frame(ev.cursor, encode_event(ev)))
                        self._quiet = False
                        self.delivered += 1
        except Exception as e:  # noqa: BLE001 - a failed hub ends its streams; clients reconnect
            log.warning("journal follower for %s stopped: %r", self.key[1], e)
            self.failed = e
        finally:
            self.done = True
            self.started.set()
            for sub in list(self.subscribers):
                sub.direct = None
                sub.send.close()
            self.subscribers.clear()
            self._on_exit(self)

    def _broadcast(self, frame: Frame) -> None:
        """Hand ``frame`` to every subscriber: written directly where its stream allows, else queued.

        The direct branch is the hot loop of a large fan-out (one iteration per follower per
        event): a duplicate check, one non-blocking send of the shared chunk, no task switch.
        """
        position = frame.position
        for sub in list(self.subscribers):
            writer = sub.direct
            if writer is not None:
                if position is not None:
                    last = sub.last
                    if last is not None and position <= last:
                        continue  # already replayed
                    sub.last = position
                if writer.try_write(frame.chunk):
                    continue
                # Written in part, or not at all: the rest is pending in the writer and the
                # stream's task takes over (it flushes, then goes direct again once caught up).
                sub.direct = None
                self.handoffs += 1
                item = _FLUSH
            else:
                item = frame
            try:
                sub.send.send_nowait(item)
            except trio.WouldBlock:
                sub.overflowed = True
                self.unsubscribe(sub)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self.subscribers.discard(sub)

    async def _heartbeats(self) -> None:
        # Ticks at half the period: a stream is silent for at most about one period.
        while True:
            await trio.sleep(self.heartbeat / 2)
            if self._quiet:
                self._broadcast(_HEARTBEAT)
            self._quiet = True

    async def _linger_watch(self, scope: trio.CancelScope) -> None:
        while True:
            await trio.sleep(HUB_LINGER_SECONDS / 2)
            if self._empty_since is not None and trio.current_time() - self._empty_since >= HUB_LINGER_SECONDS:
                scope.cancel()
                return


class Hubs:
    """Every conversation's hub, run in one nursery owned by the server."""

    def __init__(self, nursery: trio.Nursery,
                 follow: Callable[[str, str, str | None], AsyncIterator[Any]],
                 tail: Callable[[str, str], Awaitable[str | None]],
                 heartbeat: float = HEARTBEAT_SECONDS) -> None:
        self._nursery = nursery
        self.heartbeat = heartbeat
        self._follow = follow
        self._tail = tail
        self._hubs: dict[tuple[str, str], Hub] = {}
        self.closing = False

    def __len__(self) -> int:
        return len(self._hubs)

    def subscribe(self, owner: str, conversation: str) -> tuple[Hub, Subscriber]:
        key = (owner, conversation)
        hub = self._hubs.get(key)
        if hub is None or hub.done:
            hub = Hub(key, lambda after: self._follow(owner, conversation, after),
                      lambda: self._tail(owner, conversation), self._exited, self.heartbeat)
            self._hubs[key] = hub
            self._nursery.start_soon(hub.run)
        return hub, hub.subscribe()

    def _exited(self, hub: Hub) -> None:
        if self._hubs.get(hub.key) is hub:
            del self._hubs[hub.key]

    def close_all(self) -> None:
        self.closing = True
        for hub in list(self._hubs.values()):
            hub.close()


CLOSING_MESSAGE = {"message": "server shutting down; reconnect with Last-Event-ID"}


class EventStream:
    """The SSE body: replay after ``after`` from the journal, then live frames from the hub.

    Async-iterate it for the bytes to send (any ASGI front; Quart). A front that can write the
    connection directly (:func:`server.wire.open_direct_writer`) calls :meth:`attach` before
    iterating: once the stream is live and caught up, the hub writes each frame to the socket
    itself and the iterator only wakes to flush a write that came up short, or to end.

    ``read_page(after, limit)`` returns a journal page (events, next_cursor, first_retained,
    behind, more). Heartbeats come from the hub.
    """

    def __init__(self, hubs: Hubs, owner: str, conversation: str, after: str | None,
                 read_page: Callable[[str | None, int], Awaitable[Any]]) -> None:
        self._hubs = hubs
        self._owner = owner
        self._conversation = conversation
        self._after = after
        self._read_page = read_page
        self._writer: DirectWriter | None = None
        self._gen = self._frames()

    def attach(self, writer: DirectWriter) -> None:
        """Let live frames go straight to ``writer`` (call before iterating; the caller closes it)."""
        self._writer = writer

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def _frames(self) -> AsyncIterator[bytes]:
        hubs = self._hubs
        after = self._after
        hub, sub = hubs.subscribe(self._owner, self._conversation)
        try:
            yield encode_comment("surefoot events")  # opens the stream at once (headers flushed)
            with trio.move_on_after(30):
                await hub.started.wait()
            if not hub.started.is_set() or hub.failed is not None:
                return
            sub.last = after
            cursor = after
            first_page = True
            while True:
                page = await self._read_page(cursor, REPLAY_PAGE)
                if first_page and page.behind:
                    yield encode_named(BEHIND_EVENT, {
                        "after": after, "first_retained": page.first_retained,
                        "message": "the cursor fell behind retention; events before first_retained are gone, "
                                   "the stream continues from first_retained",
                    })
                first_page = False
                if page.events:
                    yield b"".join(encode_event(ev) for ev in page.events)  # one write per page
                    sub.last = page.events[-1].cursor
                cursor = page.next_cursor
                if not page.more:
                    break
            writer = self._writer
            receive = sub.receive
            while True:
                if hubs.closing:
                    break
                if writer is not None and sub.direct is None and not writer.pending \
                        and receive.statistics().current_buffer_used == 0:
                    sub.direct = writer  # caught up: the hub writes from here on
                try:
                    first = await receive.receive()  # no timeout of its own: the hub sends heartbeats
                except trio.EndOfChannel:
                    break
                # Drain whatever else is already queued and send it as one chunk: under load the
                # per-write cost is paid once per batch, not per event.
                batch: list[bytes] = []
                item: Frame | None = first
                ended = False
                while item is not None:
                    position = item.position
                    if position is None:  # a heartbeat (or a flush request: no data)
                        if item.data:
                            batch.append(item.data)
                    elif sub.last is None or position > sub.last:  # else: already replayed
                        sub.last = position
                        batch.append(item.data)
                    if len(batch) >= MAX_BATCH_FRAMES:
                        break
                    try:
                        item = receive.receive_nowait()
                    except trio.WouldBlock:
                        item = None
                    except trio.EndOfChannel:
                        item, ended = None, True
                if writer is None:
                    if batch:
                        yield b"".join(batch)
                else:
                    sub.direct = None
                    try:
                        await writer.write(chunk(b"".join(batch)) if batch else b"")
                    except trio.BrokenResourceError:
                        return  # the client is gone
                if ended:
                    break
            # Ending: nothing may still be written directly, and anything pending goes first.
            sub.direct = None
            if writer is not None:
                try:
                    await writer.flush()
                except trio.BrokenResourceError:
                    return
            if hubs.closing:
                yield encode_named(CLOSING_EVENT, CLOSING_MESSAGE)
        finally:
            sub.direct = None
            hub.unsubscribe(sub)


def stream(
    hubs: Hubs,
    owner: str,
    conversation: str,
    after: str | None,
    read_page: Callable[[str | None, int], Awaitable[Any]],
    *,
    heartbeat: float = HEARTBEAT_SECONDS,
) -> EventStream:
    """The SSE body (:class:`EventStream`). ``heartbeat`` is accepted for existing callers and
    unused: heartbeats come from the hub, at the period given to :class:`Hubs`."""
    return EventStream(hubs, owner, conversation, after, read_page)
