"""The dashboard's HTTP server: the standard library's ``ThreadingHTTPServer``, one thread per
request, and a thread that samples ``stats()`` for the backlog chart.

Why the standard library: the dashboard is a few server-rendered pages and two form posts, for
one operator at a time; ``http.server`` does that with no dependency to install, audit or keep
up with (``outboxkit[web]`` pulls in nothing), where an ASGI stack would add three.

What keeps it from hurting:

- It binds ``127.0.0.1`` unless told otherwise, and answers only requests whose ``Host`` is the
  address it serves (a page on another site cannot reach it through DNS rebinding). Bound to
  every address (``0.0.0.0``) it cannot know its names, and takes any ``Host``; the token and
  the same-origin check still hold.
- Reading is ``GET``; changing data (requeue, purge, one or in bulk) is ``POST`` only, and needs
  a session and a request from the dashboard's own pages: its ``Origin`` header (or, when a
  browser sends none, its ``Referer``) must be the dashboard's own origin. A session comes from
  signing in once with the token given at start (``POST /login``, compared in constant time):
  a random id in a cookie that is ``HttpOnly`` and ``SameSite=Strict`` (no other site's request
  carries it), for 12 hours. A cross-site form post fails twice: a foreign ``Origin``, and no
  cookie. The token and the session id are never logged (the request log names the method and
  path only); each action is one INFO line: who (the session's short id and address), what,
  how many.
- Every POST answers ``303 See Other``: the browser then GETs the page, so a reload re-posts
  nothing.
- Pages forbid framing and scripts (``Content-Security-Policy``), are not cached, and show every
  stored value as escaped text (``pages.text``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ...core.text import parse_decimal, printable
from ...errors import OutboxError
from ...outbox import MAX_EVENT_ID
from . import pages, routes
from .dashboard import SESSION_HOURS, Dashboard

__all__ = ["DashboardServer"]

log = logging.getLogger("outboxkit.web")

_MAX_BODY = 4096
_COOKIE = "outboxkit_session"
_SIGNAL_TICK = 0.2  # seconds: how soon serve_forever notices a signal another thread took
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class DashboardServer:
    """Serves a :class:`Dashboard` over HTTP.

    Args:
        dashboard: what to show.
        host: the address to bind (``127.0.0.1`` by default: this machine only).
        port: the port; 0 picks a free one (``port`` then says which).
        sample_every: seconds between samples of ``stats()`` for the backlog chart; None takes
            none but the first (the caller calls ``dashboard.sample()``, as the tests do).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(
        self,
        dashboard: Dashboard,
        *,
        host: str = "127.0.0.1",
        port: int = 8025,
        sample_every: float | None = 5.0,
    ) -> None:
        self.dashboard = dashboard
        self.sample_every = sample_every
        self._httpd = ThreadingHTTPServer((host, port), _handler_class(self))
        self._httpd.daemon_threads = True
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._serving = False

    @property
    def origin(self) -> str:
        """``http://host:port``: the only origin whose posts are taken."""
        return f"http://{self._host_port(self.host)}"

    def _host_port(self, host: str) -> str:
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def allowed_hosts(self) -> set[str] | None:
        """The ``Host`` header values this server answers; None (any) when it is bound to
        every address (``0.0.0.0``, ``::``), where it cannot know the names it is reached by."""
        if self.host in ("0.0.0.0", "::", ""):
            return None
        names = {self.host}
        if self.host in ("127.0.0.1", "::1", "localhost"):
            names |= {"127.0.0.1", "localhost", "::1"}
        return {self._host_port(name) for name in names}

    def start(self) -> None:
        """Serve in background threads (and sample, if ``sample_every`` is set)."""
        self._sample_quietly()
        serving = threading.Thread(target=self._httpd.serve_forever, name="outboxkit-web")
        self._threads.append(serving)
        self._serving = True
        if self.sample_every is not None:
            self._threads.append(
                threading.Thread(target=self._sample_loop, name="outboxkit-web-sampler")
            )
        for thread in self._threads:
            thread.daemon = True
            thread.start()

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`request_stop` or :meth:`stop` (or
        KeyboardInterrupt)."""
        self.start()
        try:
            # Timed waits, not one untimed one: a signal (Ctrl-C, SIGTERM) may be delivered to
            # one of the serving threads, and Python runs its handler only in the main thread
            # as that thread runs again, which an untimed wait would never let it do.
            while not self._stop.wait(_SIGNAL_TICK):
                pass
        finally:
            self.stop()

    def request_stop(self) -> None:
        """Make :meth:`serve_forever` return soon; it stops the server as it does. Only sets
        an event: safe from another thread and from a signal handler."""
        self._stop.set()

    def stop(self) -> None:
        """Stop serving and sampling; idempotent."""
        self._stop.set()
        if self._serving:  # shutdown() waits for a serve_forever that must have started
            self._httpd.shutdown()
            self._serving = False
        self._httpd.server_close()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

    def _sample_loop(self) -> None:
        assert self.sample_every is not None
        while not self._stop.wait(self.sample_every):
            self._sample_quietly()

    def _sample_quietly(self) -> None:
        try:
            self.dashboard.sample()
        except OutboxError as exc:
            log.warning("the dashboard could not read the store's stats: %s", exc)


def _handler_class(server: DashboardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        owner = server

    return Handler


class _Handler(BaseHTTPRequestHandler):
    owner: DashboardServer
    _answered = False
    server_version = "outboxkit-web"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        # The request line only: a form's body (where the token is) is never logged.
        log.debug("%s %s", self.command, urlsplit(self.path).path)

    # -- GET ----------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._answering(self._get)

    def do_POST(self) -> None:
        self._answering(self._post)

    def _answering(self, serve: Callable[[], None]) -> None:
        """``serve`` the request, answering it whatever happens: a bug of the dashboard is a
        500 page (its traceback goes to the log), never a connection closed without a word."""
        self._answered = False
        try:
            serve()
        except Exception:
            log.exception("dashboard: %s %s failed", self.command, urlsplit(self.path).path)
            if not self._answered:
                self._message(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    "Internal error",
                    "the dashboard failed to answer this request (its log says why)",
                )

    def _get(self) -> None:
        if not self._host_allowed():
            return
        parts = urlsplit(self.path)
        path, query = parts.path, parse_qs(parts.query)
        dashboard = self.owner.dashboard
        signed_in = dashboard.session(self._cookie()) is not None
        flash = routes.flash(query)
        try:
            if path == "/":
                self._send(HTTPStatus.OK, routes.overview(dashboard, query, signed_in, flash))
            elif path == "/events":
                self._send(HTTPStatus.OK, routes.events(dashboard, query, signed_in))
            elif path == "/dead":
                self._send(HTTPStatus.OK, routes.dead(dashboard, query, signed_in, flash))
            elif path == "/dead/preview":
                self._send(HTTPStatus.OK, routes.preview(dashboard, query, signed_in))
            elif path == "/login":
                self._send(HTTPStatus.OK, pages.login_page(signed_in))
            elif (event_id := _event_id(path)) is not None:
                event, letter = dashboard.event(event_id)
                if event is None:
                    self._message(HTTPStatus.NOT_FOUND, "No such event", f"no event {event_id}")
                else:
                    errors = dashboard.errors(event_id)
                    page = pages.event_page(event, letter, signed_in, flash, errors)
                    self._send(HTTPStatus.OK, page)
            elif (given := _event_segment(path)) is not None:
                self._message(HTTPStatus.NOT_FOUND, "No such event", _not_an_id(given))
            else:
                self._message(HTTPStatus.NOT_FOUND, "Not found", "no such page")
        except routes.BadQuery as exc:
            self._message(HTTPStatus.BAD_REQUEST, "Bad request", str(exc))
        except OutboxError as exc:
            self._message(HTTPStatus.SERVICE_UNAVAILABLE, "The store failed", str(exc))

    # -- POST ---------------------------------------------------------------------------------

    def _post(self) -> None:
        if not self._host_allowed():
            return
        if not self._same_origin():
            self._message(
                HTTPStatus.FORBIDDEN,
                "Refused",
                "cross-site request refused: actions are taken only from the dashboard's own pages",
            )
            return
        form = self._form()
        if form is None:
            return
        path = urlsplit(self.path).path
        dashboard = self.owner.dashboard
        if path == "/login":
            self._sign_in(form.get("token", [None])[0])
            return
        if path == "/logout":
            dashboard.sign_out(self._cookie())
            self._redirect("/?done=signed-out", cookie=_COOKIE + "=; Max-Age=0")
            return
        who = dashboard.session(self._cookie())
        if who is None:
            self._message(
                HTTPStatus.FORBIDDEN, "Refused", "sign in first (/login): actions need a session"
            )
            return
        who = f"{who} from {self.client_address[0]}"
        parts = path.strip("/").split("/")
        if len(parts) == 3 and parts[0] == "events" and _event_id("/".join(parts[:2])) is None:
            self._message(HTTPStatus.NOT_FOUND, "No such event", _not_an_id(parts[1]))
            return
        try:
            if path == "/dead/bulk":
                action, ids, back = routes.bulk(dashboard, form)
            else:
                action, ids, back = routes.one(dashboard, path)
            done = dashboard.actions()[action](ids)
        except routes.BadQuery as exc:
            self._message(HTTPStatus.BAD_REQUEST, "Bad request", str(exc))
            return
        except OutboxError as exc:
            self._message(HTTPStatus.SERVICE_UNAVAILABLE, "The store failed", str(exc))
            return
        verb = "requeued" if action == "requeue" else "purged"
        shown = ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
        log.info(
            "dashboard: %s %s %d dead letter(s) of %d asked: %s", who, verb, done, len(ids), shown
        )
        self._redirect(f"{back}{'&' if '?' in back else '?'}done={verb}&n={done}")

    def _sign_in(self, token: str | None) -> None:
        session = self.owner.dashboard.sign_in(token, self.client_address[0])
        if session is None:
            log.warning("dashboard: a sign-in with a wrong token from %s", self.client_address[0])
            self._message(HTTPStatus.FORBIDDEN, "Refused", "a valid token is needed to sign in")
            return
        log.info("dashboard: signed in from %s", self.client_address[0])
        self._redirect(
            "/?done=signed-in", cookie=f"{_COOKIE}={session}; Max-Age={SESSION_HOURS * 3600}"
        )

    def _cookie(self) -> str | None:
        jar = SimpleCookie()
        try:
            jar.load(self.headers.get("Cookie", ""))
        except CookieError:
            return None
        morsel = jar.get(_COOKIE)
        return None if morsel is None else morsel.value

    def _same_origin(self) -> bool:
        """The post comes from a page this server served: its ``Origin`` (or ``Referer``) is
        ``http://`` + the ``Host`` it was sent to (a host already checked)."""
        host = self.headers.get("Host")
        origin = self.headers.get("Origin")
        if origin is not None:
            return host is not None and origin == f"http://{host}"
        referer = self.headers.get("Referer")
        if referer is None or host is None:
            return False
        parts = urlsplit(referer)
        return parts.scheme == "http" and parts.netloc == host

    def _form(self) -> dict[str, list[str]] | None:
        given = self.headers.get("Content-Length")
        length = _content_length(given)
        if length is None:
            too_large = given is not None and given.isascii() and given.isdigit()
            reason = "the form is too large" if too_large else "a bad Content-Length header"
            self._message(HTTPStatus.BAD_REQUEST, "Bad request", reason)
            return None
        kind = self.headers.get("Content-Type", "").split(";", 1)[0].strip()
        if kind != "application/x-www-form-urlencoded":
            self._message(HTTPStatus.BAD_REQUEST, "Bad request", "a form post is expected")
            return None
        body = self.rfile.read(length).decode("utf-8", errors="replace")
        return parse_qs(body, keep_blank_values=True)

    # -- answers ------------------------------------------------------------------------------

    def _host_allowed(self) -> bool:
        allowed = self.owner.allowed_hosts()
        if allowed is None or self.headers.get("Host") in allowed:
            return True
        self._message(HTTPStatus.MISDIRECTED_REQUEST, "Refused", "unknown Host header")
        return False

    def _redirect(self, location: str, cookie: str | None = None) -> None:
        """303 See Other: after a POST the browser GETs ``location`` (a reload re-posts
        nothing). A cookie set here is the session's: ``HttpOnly`` (no script reads it),
        ``SameSite=Strict`` (no other site's request carries it), ``Path=/``."""
        self._answered = True
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", location)
        if cookie is not None:
            self.send_header("Set-Cookie", f"{cookie}; HttpOnly; SameSite=Strict; Path=/")
        self.send_header("Content-Length", "0")
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()

    def _message(self, status: HTTPStatus, title: str, message: str) -> None:
        self._send(status, pages.message_page(title, message))

    def _send(self, status: HTTPStatus, page: str) -> None:
        body = page.encode("utf-8")
        self._answered = True
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


def _event_segment(path: str) -> str | None:
    """The ``ID`` of ``/events/ID`` as given, or None for another path."""
    parts = path.strip("/").split("/")
    return parts[1] if len(parts) == 2 and parts[0] == "events" else None


def _event_id(path: str) -> int | None:
    """The id in ``/events/ID``, or None: ASCII digits only, 1 to 2**63 - 1 (``parse_decimal``:
    ``"²"`` is a digit to ``str.isdigit`` and no number to ``int``)."""
    given = _event_segment(path)
    return None if given is None else parse_decimal(given, minimum=1, maximum=MAX_EVENT_ID)


def _not_an_id(given: str) -> str:
    """Why ``given`` names no event (the page escapes it; control characters are shown as
    escapes, and a long one is cut)."""
    shown = printable(given if len(given) <= 40 else given[:40] + "...")
    return f"{shown!r} is not an event id (ids are numbers from 1 to {MAX_EVENT_ID})"


def _content_length(value: str | None) -> int | None:
    """The ``Content-Length`` header's value (0 when absent), or None when it is no number of
    ASCII digits (``int`` would take `` 12``, ``1_2`` or ``١٢``) or is over ``_MAX_BODY``."""
    if value is None:
        return 0
    return parse_decimal(value, maximum=_MAX_BODY)
