"""Who may talk to a batchtop server: the bind rule, the API key, Host and Origin, the body limit.

- Without an API key a server binds loopback only (`check_bind`).
- With a key every HTTP request needs `Authorization: Bearer KEY` (compared in constant time).
- `Host` must name the server: an IP address, `localhost`, the bound name, or an allowed name;
  anything else (a DNS-rebinding page's own name) gets 421. An IP literal is always allowed: a
  rebinding attack needs a name that the attacker's DNS answers.
- A request that changes state (any method but GET, HEAD, OPTIONS) or reads the event stream or the
  control state, with an `Origin` header that is neither the server's own (same scheme-less
  host:port as `Host`) nor an allowed origin, gets 403: a web page in the operator's browser cannot
  pause, step, abort or set knobs. Requests without `Origin` (curl, httpx, the dashboard) pass.
  No CORS headers are ever sent, so a cross-origin page reads no answer either.
- A body over `max_body_bytes` gets 413 before the app sees it.

`Guard` is one pure ASGI middleware (streaming-safe) holding all four; both `batchtop serve` and
the side endpoint inside vLLM mount it through `routes.mount`.
"""
from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse

from .errors import error_body
from .limits import DRAIN_BYTES, MAX_BODY_BYTES

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
READ_GUARDED_PATHS = ("/v1/events", "/v1/knobs")     # GETs a foreign page must not read either
LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain"})


@dataclass(frozen=True)
class AccessRules:
    """What `Guard` enforces; built once from a server's flags or environment."""
    api_key: str | None = None
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()          # extra names for Host ("*": any)
    allowed_origins: tuple[str, ...] = ()        # extra origins ("https://dash.example:8443"; "*": any)
    max_body_bytes: int = MAX_BODY_BYTES
    _hosts: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        names = {h.strip().lower().strip("[]") for h in self.allowed_hosts if h.strip()}
        names |= LOCAL_NAMES | {self.bound_host.lower().strip("[]")}
        object.__setattr__(self, "_hosts", frozenset(names))

    def host_allowed(self, host_header: str) -> bool:
        name = _host_name(host_header)
        if not name or "*" in self._hosts or name in self._hosts or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        origin = origin.strip().rstrip("/")
        if "*" in self.allowed_origins or origin in (o.strip().rstrip("/") for o in self.allowed_origins):
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and bool(host_header) and \
            parts.netloc.lower() == host_header.strip().lower()


def _host_name(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):                     # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def split_list(text: str | None) -> tuple[str, ...]:
    """A comma-separated environment variable as a tuple of non-empty items."""
    return tuple(item.strip() for item in (text or "").split(",") if item.strip())


class Guard:
    """Pure ASGI middleware: key, Host, Origin and body limit, in that order, before the app."""

    def __init__(self, app, rules: AccessRules):
        self.app = app
        self.rules = rules
        self.expected = f"Bearer {rules.api_key}".encode() if rules.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await refusal(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        limit = self.rules.max_body_bytes
        if declared.isdigit() and int(declared) > limit:
            return await self._too_large(scope, receive, send, size=0, more=True)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":      # the client left before its body arrived
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > limit:
                return await self._too_large(scope, receive, send, size, more)
        body, delivered = b"".join(parts), False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, replay, send)

    def _refusal(self, scope, headers: dict) -> JSONResponse | None:
        if self.expected is not None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing Authorization header" if not given else "incorrect API key"
                return JSONResponse(error_body(f"{message}: send `Authorization: Bearer <key>`",
                                               code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.rules.host_allowed(host):
            return JSONResponse(error_body(
                f"Host {host!r} is not a name of this server; allow it with --allowed-host (or "
                "$BATCHTOP_EVENTS_ALLOWED_HOSTS inside vLLM)", code="host_not_allowed"), status_code=421)
        origin = headers.get(b"origin")
        if origin is not None and (scope["method"] not in SAFE_METHODS or
                                   scope["path"].startswith(READ_GUARDED_PATHS)):
            origin_text = origin.decode("latin-1")
            if not self.rules.origin_allowed(origin_text, host):
                return JSONResponse(error_body(
                    f"requests from the web origin {origin_text!r} may not control or read this server; "
                    "allow it with --allowed-origin (or $BATCHTOP_EVENTS_ALLOWED_ORIGINS inside vLLM)",
                    code="origin_not_allowed"), status_code=403)
        return None

    async def _too_large(self, scope, receive, send, size: int, more: bool):
        while more and size <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        response = JSONResponse(error_body(
            f"the request body is over the limit of {self.rules.max_body_bytes} bytes",
            code="request_too_large"),
            status_code=413, headers={"Connection": "close"} if more else None)
        await response(scope, receive, send)


def check_bind(host: str, api_key: str | None) -> None:
    """Without an API key only loopback may be bound: ValueError otherwise."""
    if api_key:
        return
    if not is_loopback(host):
        raise ValueError(f"refusing to bind {host!r} without --api-key: without a key the server only "
                         f"listens on loopback (127.0.0.1, ::1, localhost)")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
