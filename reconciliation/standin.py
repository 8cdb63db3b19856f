"""A stand-in payments service to reconcile against (tests, `manage.py demo`).

It behaves like a business system that enforces idempotency keys: a refund is
created once per key, and can be looked up by key — which is all the ledger's http
probe needs — at `/refunds` (404 when there is none) or, as a search API answers, at
`/refunds/search` (200 with a list, empty when there is none). State lives in a
SQLite file, so several processes and restarts see the same refunds. For fault
drills the lookup can be switched to answer slowly, with 5xx, with 429 and a
Retry-After, with a malformed body, with a redirect, a byte at a time (trickle; its
status line and headers alone: trickle_head), with two megabytes (huge), with a body
that never ends (endless), compressed as a web server with compression on would
(gzip, deflate, deflate_raw), twice over (stacked), or as a few kilobytes of gzip
that inflate past 64 MiB (gzip_bomb) (`POST /_control`).

    python manage.py standin_service --port 9100
"""

from __future__ import annotations

import functools
import gzip
import json
import sqlite3
import ssl
import threading
import time
import uuid
import zlib
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

# Refunds above this are rejected by the business rules (a business_failed outcome).
REFUND_LIMIT = 10_000
ENCODED_MODES = ("gzip", "deflate", "deflate_raw", "stacked", "gzip_bomb")
LOOKUP_MODES = (
    "normal",
    "slow",
    "5xx",
    "429",
    "malformed",
    "redirect",
    "trickle",
    "trickle_head",
    "huge",
    "endless",
    *ENCODED_MODES,
)
# A trickled answer's pause between its bytes: each read of the client's waits far less
# than its read timeout, and the whole answer takes half a minute.
TRICKLE_SECONDS = 0.2
# What a 429 asks the prober to wait, in seconds.
RETRY_AFTER = 30
# A huge answer: a found refund padded to this many bytes, its length declared.
HUGE_BYTES = 2 * 1024 * 1024
# A lookup's answer when no refund has the key; any other path is answered 404 too,
# with {"error": "not_found"}, as a web framework answers a route it does not know.
NO_REFUND = {"error": "refund_not_found"}
# A gzip bomb's whitespace before the answer: valid JSON when read whole.
BOMB_BYTES = 64 * 1024 * 1024


@functools.cache
def gzip_bomb_start() -> tuple[bytes, Any]:
    """The bomb's compressed whitespace, and the compressor that made it, to be copied
    and finished with each answer (compressing 64 MiB takes a while)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return compressor.compress(b" " * BOMB_BYTES), compressor


def encoded(mode: str, raw: bytes, accepted: str) -> tuple[bytes, str | None]:
    """The answer in `mode`'s encoding, and its Content-Encoding; plain when the request
    does not accept the encoding, as a web server would answer (the bomb's and stacked
    answers are sent regardless)."""
    if mode == "gzip_bomb":
        start, compressor = gzip_bomb_start()
        compressor = compressor.copy()
        return start + compressor.compress(raw) + compressor.flush(), "gzip"
    if mode == "stacked":
        return gzip.compress(gzip.compress(raw)), "gzip, gzip"
    encoding = "deflate" if mode == "deflate_raw" else mode
    if encoding not in accepted:
        return raw, None
    if mode == "gzip":
        return gzip.compress(raw), encoding
    window = -zlib.MAX_WBITS if mode == "deflate_raw" else zlib.MAX_WBITS
    compressor = zlib.compressobj(6, zlib.DEFLATED, window)
    return compressor.compress(raw) + compressor.flush(), encoding


class Refunds:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        # Lookups this process has started answering: lets a fault drill wait until a
        # probe is really inside the business system.
        self.lookups_started = 0
        # Answers trickled head first whose prober hung up before their head was sent.
        self.heads_cut = 0
        # The Content-Encoding of each answer in an encoded mode (None: sent plain).
        self.encodings_sent: list[str | None] = []
        with self._db() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS refund (id TEXT PRIMARY KEY, "
                "idempotency_key TEXT UNIQUE NOT NULL, body TEXT NOT NULL)"
            )
            db.execute("CREATE TABLE IF NOT EXISTS control (name TEXT PRIMARY KEY, value TEXT)")

    def _db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=10, isolation_level="IMMEDIATE")

    def create(self, key: str, order: str, amount: float) -> tuple[bool, dict[str, Any]]:
        """(created, refund): one refund per idempotency key, atomically."""
        with self.lock, self._db() as db:
            row = db.execute("SELECT body FROM refund WHERE idempotency_key = ?", [key]).fetchone()
            if row:
                return False, json.loads(row[0])
            refund = {
                "id": f"RF-{uuid.uuid4().hex[:10]}",
                "idempotency_key": key,
                "order": order,
                "amount": amount,
                "status": "succeeded",
            }
            db.execute(
                "INSERT INTO refund VALUES (?, ?, ?)", [refund["id"], key, json.dumps(refund)]
            )
            return True, refund

    def find(self, key: str) -> dict[str, Any] | None:
        with self._db() as db:
            row = db.execute("SELECT body FROM refund WHERE idempotency_key = ?", [key]).fetchone()
        return json.loads(row[0]) if row else None

    def count(self, key: str | None = None) -> int:
        with self._db() as db:
            if key is None:
                return int(db.execute("SELECT count(*) FROM refund").fetchone()[0])
            return int(
                db.execute(
                    "SELECT count(*) FROM refund WHERE idempotency_key = ?", [key]
                ).fetchone()[0]
            )

    def mode(self) -> str:
        with self._db() as db:
            row = db.execute("SELECT value FROM control WHERE name = 'lookup'").fetchone()
        return row[0] if row else "normal"

    def set_mode(self, mode: str) -> None:
        with self._db() as db:
            db.execute("INSERT OR REPLACE INTO control VALUES ('lookup', ?)", [mode])


def handler_for(refunds: Refunds, slow_seconds: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(raw)

        def body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}")

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            if url.path == "/stats":
                self.reply(200, {"refunds": refunds.count()})
                return
            if url.path == "/refunds/search":  # as a search API answers: a list, maybe empty
                found = refunds.find(query.get("idempotency_key", [""])[0])
                self.reply(200, {"data": [found] if found else []})
                return
            if url.path != "/refunds":
                self.reply(404, {"error": "not_found"})
                return
            with refunds.lock:
                refunds.lookups_started += 1
            mode = refunds.mode()
            if mode == "slow":
                time.sleep(slow_seconds)
            if mode == "5xx":
                self.reply(503, {"error": "unavailable"})
                return
            if mode == "429":
                self.reply(429, {"error": "rate_limited"}, {"Retry-After": str(RETRY_AFTER)})
                return
            if mode == "malformed":
                self.reply(200, b"{not json")
                return
            if mode == "redirect":
                self.reply(302, {}, {"Location": "http://elsewhere.invalid/refunds"})
                return
            refund = refunds.find(query.get("idempotency_key", [""])[0])
            if mode == "huge" and refund:
                padding = HUGE_BYTES - len(json.dumps(refund)) - len(', "note": ""')
                refund = {**refund, "note": "x" * padding}
            try:
                if mode == "trickle":
                    self.trickle(200, refund) if refund else self.trickle(404, NO_REFUND)
                elif mode == "trickle_head":
                    self.trickle_head(200, refund) if refund else self.trickle_head(404, NO_REFUND)
                elif mode == "endless":
                    self.endless()
                elif mode in ENCODED_MODES:
                    status, body = (200, refund) if refund else (404, NO_REFUND)
                    raw, encoding = encoded(
                        mode, json.dumps(body).encode(), self.headers.get("Accept-Encoding", "")
                    )
                    with refunds.lock:
                        refunds.encodings_sent.append(encoding)
                    self.reply(status, raw, {"Content-Encoding": encoding} if encoding else None)
                else:
                    self.reply(200, refund) if refund else self.reply(404, NO_REFUND)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the probe stopped reading, as it should

        def trickle(self, status: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.send_slowly(raw)

        def trickle_head(self, status: int, body: Any) -> None:
            """The status line and headers a byte at a time, then the body at once."""
            raw = json.dumps(body).encode()
            head = (
                f"{self.protocol_version} {status} {HTTPStatus(status).phrase}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
            )
            try:
                self.send_slowly(head.encode())
            except (BrokenPipeError, ConnectionResetError):
                with refunds.lock:
                    refunds.heads_cut += 1
                raise
            self.wfile.write(raw)

        def send_slowly(self, raw: bytes) -> None:
            for byte in raw:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(TRICKLE_SECONDS)

        def endless(self) -> None:
            """A JSON body of no declared length that never ends."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status": "succeeded", "note": "')
            while True:
                self.wfile.write(b"x" * 65536)

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            try:
                body = self.body()
            except ValueError:
                self.reply(400, {"error": "bad json"})
                return
            if url.path == "/_control":
                if body.get("lookup") not in LOOKUP_MODES:
                    self.reply(400, {"error": f"lookup must be one of {LOOKUP_MODES}"})
                    return
                refunds.set_mode(body["lookup"])
                self.reply(200, {"lookup": body["lookup"]})
                return
            if url.path != "/refunds":
                self.reply(404, {"error": "not_found"})
                return
            key, amount = body.get("idempotency_key"), body.get("amount")
            if not key or not isinstance(amount, int | float):
                self.reply(400, {"error": "idempotency_key and amount are required"})
                return
            if amount > REFUND_LIMIT:
                self.reply(422, {"error": "refund_limit_exceeded"})
                return
            created, refund = refunds.create(key, str(body.get("order", "")), amount)
            self.reply(HTTPStatus.CREATED if created else HTTPStatus.OK, refund)

    return Handler


class StandInService:
    """The service on a local port, in a background thread (or `serve_forever`)."""

    def __init__(
        self,
        db_path: Path,
        port: int = 0,
        slow_seconds: float = 30.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: serve https with this server context (its certificate loaded)."""
        self.refunds = Refunds(db_path)
        self.server = ThreadingHTTPServer(
            ("127.0.0.1", port), handler_for(self.refunds, slow_seconds)
        )
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.scheme = "https" if tls else "http"
        self.server.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{self.scheme}://{host!s}:{port}"

    def start(self) -> StandInService:
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def probe_config(self) -> dict[str, Any]:
        """The ledger http probe that looks refunds up here by idempotency key."""
        return {
            "kind": "http",
            "url": f"{self.url}/refunds?idempotency_key={{idempotency_key}}",
            "connect_timeout": 2,
            "read_timeout": 2,
            "present": {
                "status": 200,
                "json_path": "status",
                "equals": "succeeded",
                "reference_path": "id",
            },
            "absent": {"status": 404, "json_path": "error", "equals": "refund_not_found"},
        }
