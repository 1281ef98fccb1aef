"""The direct SSE write path (server.wire): the hub writes live frames to the socket itself.

Checked here: the path is really taken with the installed hypercorn (an upgrade that loses it
fails here, not only in the benchmark); what goes out is valid HTTP/1.1 chunked coding with every
event exactly once and in order, also when the kernel takes writes only in part (a slow reader)
and the subscriber's own task has to finish them; turning the path off gives the same stream;
a client that vanishes mid-stream is released; and DirectWriter's own contract on a socketpair.
"""

from __future__ import annotations

import json
import os
import socket
from urllib.parse import urlsplit

import h11
import httpx
import pytest
import trio

import server.app
from server.wire import DirectWriter, chunk, open_direct_writer

from server_helpers import TOKEN, SSEReader, parse_sse, serving, wait_settled

SSE = {"Accept": "text/event-stream"}


def live_subscribers(s, conv: str) -> list:
    return [sub for key, h in list(s.api.hubs._hubs.items()) if key[1] == conv for sub in h.subscribers]


def hub_of(s, conv: str):
    return next(h for key, h in list(s.api.hubs._hubs.items()) if key[1] == conv)


async def wait_direct(s, conv: str, n: int = 1) -> None:
    with trio.fail_after(10):
        while sum(sub.direct is not None for sub in live_subscribers(s, conv)) < n:
            await trio.sleep(0.01)


async def journal_after(c: httpx.AsyncClient, conv: str, after: str) -> list[str]:
    ids: list[str] = []
    while True:
        page = (await c.get(f"/v1/conversations/{conv}/events", params={"after": after, "limit": 1000})).json()
        ids += [e["cursor"] for e in page["events"]]
        if not page["more"]:
            return ids
        after = page["next_cursor"]


async def emit(s, conv: str, n: int, size: int = 16) -> list[str]:
    return [await s.rt.store.journal.emit_one(s.rt.owner, conv, "part.added", {"i": i, "text": "x" * size})
            for i in range(n)]


@pytest.mark.parametrize("direct", [True, False])
async def test_live_frames_arrive_once_in_order_with_and_without_the_direct_path(monkeypatch, direct):
    monkeypatch.setattr(server.app, "DIRECT_SSE_WRITES", direct)
    async with serving() as s:
        async with s.client() as c:
            ack = (await c.post("/v1/conversations/c/messages", json={"message": "hi"})).json()
            await wait_settled(c, ack["run_id"])
            start = (await c.get("/v1/conversations/c/events")).json()["next_cursor"]
            async with c.stream("GET", f"/v1/conversations/c/events?after={start}", headers=SSE) as r:
                reader = SSEReader(r)
                assert (await reader.next()).get("comment") == "surefoot events"
                if direct:
                    await wait_direct(s, "c")  # the installed hypercorn is recognised
                else:
                    with trio.move_on_after(0.2):
                        await wait_direct(s, "c")
                    assert all(sub.direct is None for sub in live_subscribers(s, "c"))
                cursors = await emit(s, "c", 30)
                frames = await reader.events_until(lambda f: f.get("id") == cursors[-1])
            assert [f["id"] for f in frames] == cursors
            assert [json.loads(f["data"])["data"]["i"] for f in frames] == list(range(30))
            assert cursors == await journal_after(c, "c", start)


async def test_a_slow_reader_gets_valid_chunks_and_every_event_once_through_partial_writes():
    async with serving() as s:
        async with s.client() as c:
            ack = (await c.post("/v1/conversations/c/messages", json={"message": "hi"})).json()
            await wait_settled(c, ack["run_id"])
            start = (await c.get("/v1/conversations/c/events")).json()["next_cursor"]
        host, port = urlsplit(s.url).hostname, urlsplit(s.url).port
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        await sock.connect((host, port))
        stream = trio.SocketStream(sock)
        await stream.send_all((f"GET /v1/conversations/c/events?after={start} HTTP/1.1\r\nHost: t\r\n"
                               f"Authorization: Bearer {TOKEN}\r\nAccept: text/event-stream\r\n\r\n").encode())
        await wait_direct(s, "c")
        (sub,) = live_subscribers(s, "c")
        # A small send buffer on the server side of this connection (no autotuning): with the reader
        # not reading, direct writes soon come up short and the subscriber's task must finish them.
        server_side = socket.socket(fileno=os.dup(sub.direct.fileno()))
        server_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        server_side.close()
        cursors = await emit(s, "c", 60, size=20_000)  # ~1.2 MB while nobody reads
        with trio.fail_after(10):
            while hub_of(s, "c").handoffs < 1:
                await trio.sleep(0.01)
        # Now read slowly, through h11 (which rejects any broken chunk framing).
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="GET", target="/", headers=[("Host", "t")]))
        client.send(h11.EndOfMessage())
        body = ""
        ids: list[str] = []
        with trio.fail_after(30):
            while not ids or ids[-1] != cursors[-1]:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    await trio.sleep(0.001)
                    client.receive_data(await stream.receive_some(8192))
                    continue
                if isinstance(event, h11.Response):
                    assert event.status_code == 200
                    assert (b"transfer-encoding", b"chunked") in [(k.lower(), v) for k, v in event.headers]
                elif isinstance(event, h11.Data):
                    frames, body = parse_sse(body + bytes(event.data).decode())
                    ids += [f["id"] for f in frames if "id" in f]
        assert ids == cursors, "every event exactly once, in order"
        # caught up again: back on the direct path
        await wait_direct(s, "c")
        more = await emit(s, "c", 3)
        with trio.fail_after(10):
            while ids[-1] != more[-1]:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some(8192))
                elif isinstance(event, h11.Data):
                    frames, body = parse_sse(body + bytes(event.data).decode())
                    ids += [f["id"] for f in frames if "id" in f]
        assert ids == cursors + more
        await stream.aclose()


async def test_a_vanished_direct_client_is_released_and_others_keep_receiving():
    async with serving() as s:
        async with s.client() as c, s.client() as c2:
            ack = (await c.post("/v1/conversations/c/messages", json={"message": "hi"})).json()
            await wait_settled(c, ack["run_id"])
            start = (await c.get("/v1/conversations/c/events")).json()["next_cursor"]
            async with c.stream("GET", f"/v1/conversations/c/events?after={start}", headers=SSE) as keep:
                reader = SSEReader(keep)
                await reader.next()
                async with c2.stream("GET", f"/v1/conversations/c/events?after={start}", headers=SSE) as gone:
                    gone_reader = SSEReader(gone)  # kept: a collected reader closes its response
                    await gone_reader.next()
                    await wait_direct(s, "c", 2)
                # c2's stream is closed; events keep coming for the other follower
                cursors = await emit(s, "c", 20)
                frames = await reader.events_until(lambda f: f.get("id") == cursors[-1])
                assert [f["id"] for f in frames] == cursors
                with trio.fail_after(10):
                    while len(live_subscribers(s, "c")) != 1:
                        await trio.sleep(0.02)


async def test_direct_writer_contract_on_a_socketpair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    lock = trio.Lock()
    w = DirectWriter(a, lock)
    assert chunk(b"hello") == b"5\r\nhello\r\n"
    assert w.try_write(chunk(b"hello")) and not w.pending
    assert b.recv(100) == b"5\r\nhello\r\n"
    # while hypercorn holds the connection's send lock, nothing is written now: it is held, in order
    async with lock:
        assert not w.try_write(chunk(b"later"))
        assert w.pending == chunk(b"later")
    await w.flush()
    assert b.recv(100) == chunk(b"later") and not w.pending
    # fill the socket: the tail of a write is held, later writes queue behind it
    big = chunk(b"x" * 65536)
    while w.try_write(big):
        pass
    assert w.pending
    assert not w.try_write(chunk(b"end"))
    received = bytearray()

    async def drain() -> None:
        while not received.endswith(chunk(b"end")):
            await trio.lowlevel.wait_readable(b)
            received.extend(b.recv(1 << 20))

    async with trio.open_nursery() as n:
        n.start_soon(drain)
        await w.flush()
    assert not w.pending and received.endswith(b"x\r\n" + chunk(b"end"))
    # the peer goes away: the writer turns broken, flush says so, and close is idempotent
    b.close()
    with trio.fail_after(5):
        while not w.broken:
            w.try_write(big)
            await trio.sleep(0)
    with pytest.raises(trio.BrokenResourceError):
        await w.flush()
    w.close()
    w.close()
    assert w.fileno() == -1


def test_open_direct_writer_refuses_what_it_does_not_recognise():
    async def send(message):  # not hypercorn's HTTPStream.app_send
        pass

    assert open_direct_writer(send) is None
    assert open_direct_writer(print) is None
    assert open_direct_writer(object()) is None


async def test_a_hub_whose_direct_write_fails_hands_over_and_the_stream_ends():
    """Hub + EventStream + DirectWriter without HTTP: a replayed event is not written twice, live ones
    are written by the hub itself, and a peer that vanished ends the stream and its subscription."""
    from types import SimpleNamespace

    from server import sse
    from sessions.journal import Event

    events_in, events_out = trio.open_memory_channel(100)

    async def follow(owner, conv, after):
        async for ev in events_out:
            yield ev

    async def tail(owner, conv):
        return None

    def ev(i: int) -> Event:
        return Event(f"{i:024x}", "part.added", {"i": i}, 1.0)

    async def read_page(cursor, limit):  # the replay: event 1 is already in the journal
        events = [ev(1)] if cursor is None else []
        return SimpleNamespace(events=events, next_cursor=events[-1].cursor if events else cursor,
                               first_retained=None, behind=False, more=False)

    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    writer = DirectWriter(a, trio.Lock())
    async with trio.open_nursery() as n:
        hubs = sse.Hubs(n, follow, tail)
        st = sse.stream(hubs, "o", "c", None, read_page)
        st.attach(writer)
        yielded: list[bytes] = []
        ended = trio.Event()

        async def consume():
            async for data in st:
                yielded.append(data)
            ended.set()

        n.start_soon(consume)
        with trio.fail_after(5):
            while not any(sub.direct is not None for h in hubs._hubs.values() for sub in h.subscribers):
                await trio.sleep(0.01)
        assert yielded == [sse.encode_comment("surefoot events"), sse.encode_event(ev(1))]  # through ASGI
        await events_in.send(ev(1))  # the hub sees the replayed event too: dropped
        await events_in.send(ev(2))
        with trio.fail_after(5):
            got = b""
            while not got.endswith(chunk(sse.encode_event(ev(2)))):
                await trio.lowlevel.wait_readable(b)
                got += b.recv(65536)
        assert got == chunk(sse.encode_event(ev(2))), "written directly, once, as one chunk"
        assert len(yielded) == 2
        b.close()
        for i in range(3, 10):
            await events_in.send(ev(i))
        with trio.fail_after(5):
            await ended.wait()
        assert not any(h.subscribers for h in hubs._hubs.values())
        assert writer.broken
        hubs.close_all()
    writer.close()
