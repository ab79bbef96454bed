"""The dashboard server's guards, request by request (no browser): which posts are taken."""

from __future__ import annotations

import http.client
import signal
import threading
from collections.abc import Iterator

import pytest

from outboxkit import EventBus, FrozenClock, MemoryStore, Outbox
from outboxkit.contrib.web import Dashboard, DashboardServer
from outboxkit.errors import ConfigurationError

TOKEN = "server-test-token"


@pytest.fixture
def dead_letter() -> Iterator[tuple[Outbox, int]]:
    store = MemoryStore()
    bus = EventBus()

    @bus.handler("t", name="h")
    def fail(event: object, ctx: object) -> None:
        raise RuntimeError("down")

    outbox = Outbox(store, bus, clock=FrozenClock(), max_retries=0, load_entry_points=False)
    with store.transaction() as tx:
        event_id = outbox.enqueue(tx, "t", {})
    assert outbox.poller().run_once().dead_lettered == [event_id]
    yield outbox, event_id
    store.close()


@pytest.fixture
def server(dead_letter: tuple[Outbox, int]) -> Iterator[DashboardServer]:
    served = DashboardServer(Dashboard(dead_letter[0], token=TOKEN), port=0, sample_every=None)
    served.start()
    yield served
    served.stop()


def _post(server: DashboardServer, path: str, body: str, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(
            "POST",
            path,
            body=body,
            headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
        )
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_post_is_taken_only_with_the_token_from_the_dashboards_own_origin(
    server: DashboardServer, dead_letter: tuple[Outbox, int]
) -> None:
    outbox, event_id = dead_letter
    path = f"/events/{event_id}/requeue"
    host = f"127.0.0.1:{server.port}"
    token = f"token={TOKEN}"
    assert _post(server, path, token, {}) == 403  # neither Origin nor Referer
    assert _post(server, path, token, {"Origin": "http://evil.example"}) == 403
    assert _post(server, path, token, {"Origin": "null"}) == 403  # a sandboxed or blank page
    assert _post(server, path, token, {"Referer": "http://evil.example/x"}) == 403
    assert _post(server, path, "token=wrong", {"Origin": f"http://{host}"}) == 403
    assert _post(server, path, "", {"Origin": f"http://{host}"}) == 403
    assert outbox.dead_letter(event_id) is not None  # nothing was done
    assert _post(server, path, token, {"Referer": f"http://{host}/events/{event_id}"}) == 200
    assert outbox.dead_letter(event_id) is None
    assert _post(server, path, token, {"Origin": f"http://{host}"}) == 409  # not dead any more


def test_a_foreign_host_is_refused_and_a_short_token_is_not_taken(
    server: DashboardServer, dead_letter: tuple[Outbox, int]
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/", headers={"Host": "rebound.example"})
        assert conn.getresponse().status == 421
    finally:
        conn.close()
    with pytest.raises(ConfigurationError, match="at least 8 characters"):
        Dashboard(dead_letter[0], token="short")


def test_a_signal_another_thread_took_stops_serve_forever(
    dead_letter: tuple[Outbox, int],
) -> None:
    """Ctrl-C reaches serve_forever even when the kernel hands SIGINT to a thread other than
    the main one (Python runs the handler in the main thread only, once it runs again)."""
    served = DashboardServer(Dashboard(dead_letter[0], token=TOKEN), port=0, sample_every=None)
    interrupted = threading.Event()
    stopped_by_guard: list[bool] = []

    def interrupt_from_another_thread() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
        try:  # answered: the server is serving, the main thread waits in serve_forever
            conn.request("GET", "/")
            assert conn.getresponse().status == 200
        finally:
            conn.close()
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # taken by this thread
        if not interrupted.wait(timeout=30):  # a guard, not a timing: without it, a hang
            stopped_by_guard.append(True)
            served.stop()

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    other = threading.Thread(target=interrupt_from_another_thread)
    try:
        other.start()
        with pytest.raises(KeyboardInterrupt):
            served.serve_forever()
    finally:
        interrupted.set()
        other.join(timeout=60)
        signal.signal(signal.SIGINT, previous)
    assert not other.is_alive()
    assert not stopped_by_guard, "serve_forever went on serving after the signal"
