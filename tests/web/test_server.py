"""The dashboard server's guards, request by request (no browser): which posts are taken."""

from __future__ import annotations

import http.client
import signal
import socket
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


def _answer(
    server: DashboardServer, path: str, body: str, headers: dict[str, str]
) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(
            "POST",
            path,
            body=body,
            headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
        )
        response = conn.getresponse()
        response.read()
        return response
    finally:
        conn.close()


def _post(server: DashboardServer, path: str, body: str, headers: dict[str, str]) -> int:
    return _answer(server, path, body, headers).status


def _sign_in(server: DashboardServer, token: str = TOKEN) -> str:
    """Sign in; the ``Cookie`` header of the session."""
    origin = f"http://127.0.0.1:{server.port}"
    response = _answer(server, "/login", f"token={token}", {"Origin": origin})
    assert response.status == 303, response.status
    cookie = response.getheader("Set-Cookie") or ""
    return cookie.split(";", 1)[0]


def test_an_action_is_taken_only_in_a_session_from_the_dashboards_own_origin(
    server: DashboardServer, dead_letter: tuple[Outbox, int]
) -> None:
    outbox, event_id = dead_letter
    path = f"/events/{event_id}/requeue"
    host = f"127.0.0.1:{server.port}"
    # Signing in: the token once, from the dashboard's own origin; a cookie no script reads
    # and no other site's request carries.
    assert _post(server, "/login", f"token={TOKEN}", {"Origin": "http://evil.example"}) == 403
    wrong = _answer(server, "/login", "token=wrong-token", {"Origin": f"http://{host}"})
    assert wrong.status == 403 and wrong.getheader("Set-Cookie") is None
    signed = _answer(server, "/login", f"token={TOKEN}", {"Origin": f"http://{host}"})
    assert signed.status == 303 and signed.getheader("Location") == "/?done=signed-in"
    set_cookie = signed.getheader("Set-Cookie") or ""
    assert set_cookie.startswith("outboxkit_session=")
    assert "; HttpOnly" in set_cookie and "; SameSite=Strict" in set_cookie
    assert "; Path=/" in set_cookie
    cookie = set_cookie.split(";", 1)[0]
    # An action: a session and the dashboard's own origin, no token per action.
    assert _post(server, path, "", {"Origin": f"http://{host}"}) == 403  # no session
    assert _post(server, path, "", {"Cookie": cookie}) == 403  # neither Origin nor Referer
    assert _post(server, path, "", {"Cookie": cookie, "Origin": "http://evil.example"}) == 403
    assert _post(server, path, "", {"Cookie": cookie, "Origin": "null"}) == 403
    forged = "outboxkit_session=" + "x" * 43
    assert _post(server, path, "", {"Cookie": forged, "Origin": f"http://{host}"}) == 403
    assert outbox.dead_letter(event_id) is not None  # nothing was done
    done = _answer(server, path, "", {"Cookie": cookie, "Referer": f"http://{host}/x"})
    # Redirected after the POST: a reload of the page re-posts nothing.
    assert done.status == 303
    assert done.getheader("Location") == f"/events/{event_id}?done=requeued&n=1"
    assert outbox.dead_letter(event_id) is None
    again = _answer(server, path, "", {"Cookie": cookie, "Origin": f"http://{host}"})
    assert again.getheader("Location") == f"/events/{event_id}?done=requeued&n=0"
    out = _answer(server, "/logout", "", {"Cookie": cookie, "Origin": f"http://{host}"})
    assert out.status == 303 and "Max-Age=0" in (out.getheader("Set-Cookie") or "")
    assert _post(server, path, "", {"Cookie": cookie, "Origin": f"http://{host}"}) == 403


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


def _raw(server: DashboardServer, request: bytes) -> tuple[int, str]:
    """Send ``request`` as it is (a browser or http.client would encode its path first), and
    read the answer to the end: its status and page. No answer at all fails the test."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer, "the server closed the connection without an answer"
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body.decode("utf-8")


def _get_raw(server: DashboardServer, path: bytes) -> tuple[int, str]:
    host = f"127.0.0.1:{server.port}".encode()
    return _raw(
        server, b"GET " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
    )


def _post_raw(
    server: DashboardServer, path: bytes, body: bytes, *, length: bytes | None = None
) -> tuple[int, str]:
    host = f"127.0.0.1:{server.port}".encode()
    length = str(len(body)).encode() if length is None else length
    cookie = _sign_in(server).encode()
    return _raw(
        server,
        b"POST "
        + path
        + b" HTTP/1.1\r\nHost: "
        + host
        + b"\r\nCookie: "
        + cookie
        + b"\r\nOrigin: http://"
        + host
        + b"\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: "
        + length
        + b"\r\nConnection: close\r\n\r\n"
        + body,
    )


def test_dashboard_superscript_event_id(
    server: DashboardServer, dead_letter: tuple[Outbox, int]
) -> None:
    """Bug 11: ``/events/²`` (the request line is read as Latin-1: the byte 0xB2 is "²", which
    ``str.isdigit`` takes and ``int`` refuses) was a traceback and no answer. Now a 404 page,
    for GET and POST alike, and the server goes on serving."""
    outbox, event_id = dead_letter
    token = f"token={TOKEN}".encode()
    for path in (b"/events/\xb2", b"/events/\xb9\xb3", b"/events/1\xb2"):
        status, page = _get_raw(server, path)
        assert (status, "is not an event id" in page) == (404, True), (path, page)
        status, page = _post_raw(server, path + b"/requeue", token)
        assert (status, "is not an event id" in page) == (404, True), (path, page)
    assert outbox.dead_letter(event_id) is not None  # nothing was done
    status, page = _get_raw(server, f"/events/{event_id}".encode())
    assert status == 200 and "down" in page  # still serving: the dead letter's page


_NOT_IDS = [
    b"9" * 5000,  # past int()'s 4,300 digits: its own ValueError
    b"9223372036854775808",  # 2**63
    b"0",
    b"-1",
    b"+1",
    b"1_0",
    b"%31",  # "1", percent-encoded: paths are taken as sent
]


def test_dashboard_event_id_is_ascii_decimal_and_bounded(
    server: DashboardServer, dead_letter: tuple[Outbox, int]
) -> None:
    outbox, event_id = dead_letter
    token = f"token={TOKEN}".encode()
    for segment in _NOT_IDS:
        status, page = _get_raw(server, b"/events/" + segment)
        assert (status, "is not an event id" in page) == (404, True), segment[:40]
        status, page = _post_raw(server, b"/events/" + segment + b"/purge", token)
        assert (status, "is not an event id" in page) == (404, True), segment[:40]
    assert outbox.dead_letter(event_id) is not None


def test_dashboard_content_length_is_ascii_decimal(
    server: DashboardServer, dead_letter: tuple[Outbox, int]
) -> None:
    outbox, event_id = dead_letter
    body = f"token={TOKEN}".encode()
    path = f"/events/{event_id}/requeue".encode()
    for length in (b"\xb2", b"1_0", b"-1", b"+9", b"99999999999999999999999"):
        status, page = _post_raw(server, path, body, length=length)
        expected = "the form is too large" if length.isdigit() else "a bad Content-Length header"
        assert (status, expected in page) == (400, True), (length, page)
        assert outbox.dead_letter(event_id) is not None
    status, page = _post_raw(server, path, body)
    assert status == 303 and outbox.dead_letter(event_id) is None


def test_a_failure_of_the_dashboard_is_a_500_page_not_a_dropped_connection(
    server: DashboardServer, dead_letter: tuple[Outbox, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, event_id = dead_letter

    def broken(event_id: int) -> object:
        raise ValueError("a bug")

    monkeypatch.setattr(server.dashboard, "event", broken)
    status, page = _get_raw(server, f"/events/{event_id}".encode())
    assert status == 500 and "the dashboard failed to answer this request" in page
    assert "a bug" not in page  # the log has it, not the page
