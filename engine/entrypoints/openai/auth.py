"""One API key for everything a server serves: the OpenAI API, /metrics, and a UI mounted beside them.

With a key, every path except `/health` (for load-balancer probes) needs `Authorization: Bearer <key>`, or
the session cookie that `POST /login` sets after the same key is typed into the login page (`GET /login`).
A browser asking for a page without either is sent to the login page; other requests get the OpenAI-style
401; a WebSocket is closed with 1008 (policy violation). The cookie holds an HMAC of the key, never the key,
and is HttpOnly and SameSite=Lax (sent on links into the app, never on cross-site posts). Pure ASGI, so
streams and disconnects pass through untouched.
"""
from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
from urllib.parse import parse_qs, quote

from engine.entrypoints.openai.errors import unauthorized

COOKIE = "kvscope_session"
EXEMPT_PATHS = frozenset({"/health"})
LOGIN_PATH = "/login"
MAX_LOGIN_BODY = 4096


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> str | None:
    """The CLI's rule for binding: a non-loopback address needs an API key or --allow-unauthenticated.
    Returns a warning to print (None: nothing to say); raises ValueError when the bind is refused."""
    if api_key or is_loopback(host):
        return None
    if not allow_unauthenticated:
        raise ValueError(f"--host {host}: serving a non-loopback address without --api-key lets anyone who can "
                         "reach it use the engine (and the UI's settings); pass --api-key KEY, or "
                         "--allow-unauthenticated to do it anyway")
    return (f"WARNING: serving {host} without an API key (--allow-unauthenticated): anyone who can reach this "
            "address can use the engine")


def _login_page(next_path: str, failed: bool) -> bytes:
    err = '<p style="color:#b00020">Wrong key.</p>' if failed else ""
    return (f"""<!doctype html><html><head><meta charset="utf-8"><title>kvscope: sign in</title></head>
<body style="font-family:sans-serif;max-width:22em;margin:4em auto">
<h3>kvscope</h3><p>This server needs its API key.</p>{err}
<form method="post" action="{LOGIN_PATH}"><input type="hidden" name="next" value="{html.escape(next_path)}">
<input type="password" name="key" placeholder="API key" autofocus style="width:100%">
<p><button type="submit">Sign in</button></p></form></body></html>""").encode()


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()
        self._session = hmac.new(self._key, b"kvscope-session", hashlib.sha256).hexdigest().encode()

    def authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return True
            elif name == b"cookie":
                for part in value.split(b";"):
                    k, _, v = part.strip().partition(b"=")
                    if k == COOKIE.encode() and hmac.compare_digest(v.strip(), self._session):
                        return True
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in EXEMPT_PATHS:
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope["path"] == LOGIN_PATH:
            return await self._login(scope, receive, send)
        if self.authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = dict(scope.get("headers", []))
        if scope["method"] == "GET" and b"text/html" in headers.get(b"accept", b""):
            target = scope["path"] + (("?" + scope["query_string"].decode("latin-1")) if scope["query_string"] else "")
            await _respond(send, 303, b"", [(b"location", f"{LOGIN_PATH}?next={quote(target)}".encode())])
            return
        await unauthorized()(scope, receive, send)

    async def _login(self, scope, receive, send):
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if scope["method"] != "POST":
            return await _respond(send, 200, _login_page(_safe_next(query.get("next", ["/"])[0]), False),
                                  [(b"content-type", b"text/html; charset=utf-8")])
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > MAX_LOGIN_BODY:
                return await _respond(send, 413, b"login form too large", [(b"content-type", b"text/plain")])
            if not msg.get("more_body"):
                break
        form = parse_qs(body.decode("utf-8", "replace"))
        key = form.get("key", [""])[0].encode()
        nxt = _safe_next(form.get("next", ["/"])[0])
        if not hmac.compare_digest(key, self._key):
            return await _respond(send, 401, _login_page(nxt, True), [(b"content-type", b"text/html; charset=utf-8")])
        cookie = f"{COOKIE}={self._session.decode()}; Path=/; HttpOnly; SameSite=Lax".encode()
        await _respond(send, 303, b"", [(b"location", nxt.encode()), (b"set-cookie", cookie)])


def _safe_next(path: str) -> str:
    """Only a path on this server (no scheme, no `//host`) to go back to after login."""
    return path if path.startswith("/") and not path.startswith("//") and "\\" not in path else "/"


async def _respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
