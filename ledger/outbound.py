"""Requests the ledger sends outside itself: probes to business systems, anchors to a
store or a time-stamping authority. Each answer is read whole by a deadline and
within a size, or not at all.

httpx bounds each read of a connection, not the answer: a server sending a byte at a
time, a body without end or a name its resolver never answers would hold the worker's
thread, or fill its memory, for as long as it liked. A client given to
`reading_by_deadline`, asked within `deadline(seconds)` and read by `read_answer`, is
bounded in all three.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

# The most of an answer the ledger reads: a probe's lookup is answered in a few hundred
# bytes, a timestamp in a few thousand.
ANSWER_MAX_BYTES = 1024 * 1024


class UnreadAnswer(Exception):
    """An answer too long, or too slow to finish, to be read."""


# The encodings the ledger asks for and undoes itself, with their zlib window bits.
ACCEPT_ENCODING = "gzip, deflate"
ZLIB_WINDOWS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class _Decoder:
    """An answer's content-encoding undone as its parts arrive, never more than the room
    left at a time. httpx's decoders inflate a whole read at once: one 64 KiB read of
    gzip can hold 64 MiB."""

    def __init__(self, encoding: str, limit: int) -> None:
        if encoding not in ("identity", *ZLIB_WINDOWS):
            raise UnreadAnswer(
                f"answer encoded as {encoding!r}; the ledger reads {ACCEPT_ENCODING}"
            )
        self.limit = limit
        self.encoding = encoding
        self.zlib = zlib.decompressobj(ZLIB_WINDOWS[encoding]) if encoding in ZLIB_WINDOWS else None
        self.started = False

    def decode(self, data: bytes, room: int) -> bytes:
        if self.zlib is None:
            decoded = data
        else:
            try:
                decoded = self.zlib.decompress(data, room + 1)
            except zlib.error as exc:
                if self.encoding != "deflate" or self.started:
                    raise UnreadAnswer(f"answer is not valid {self.encoding}: {exc}") from exc
                # Some servers send deflate without its zlib header, as httpx allows.
                self.zlib = zlib.decompressobj(-zlib.MAX_WBITS)
                self.started = True
                return self.decode(data, room)
            self.started = self.started or bool(data)
        if len(decoded) > room:
            raise UnreadAnswer(f"answer over {self.limit} bytes")
        return decoded

    def finish(self) -> None:
        if self.zlib is not None and self.started and not self.zlib.eof:
            raise UnreadAnswer(f"answer's {self.encoding} stream ends early")


def read_answer(response: httpx.Response, limit: int = ANSWER_MAX_BYTES) -> bytes:
    """A streamed answer's body, decoded, within `limit` bytes (its reads keep the
    deadline, _DeadlineStream)."""
    declared = response.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > limit:
        raise UnreadAnswer(f"answer of {declared} bytes, over {limit}")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    decoder = _Decoder(encoding, limit)
    body = bytearray()
    for chunk in response.iter_raw():
        body += decoder.decode(chunk, room=limit - len(body))
    decoder.finish()
    return bytes(body)


# When this thread's request must have its whole answer; None outside `deadline`.
_answer_deadline: ContextVar[float | None] = ContextVar("answer_deadline", default=None)
ANSWER_LATE = "answer not finished within the connect and read timeouts"


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Every read of a `reading_by_deadline` client's connections in the block ends
    `seconds` from now at the latest: its answer's status line, headers and body."""
    token = _answer_deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _answer_deadline.reset(token)


def _until_deadline(timeout: float | None) -> float | None:
    """A read's timeout, no later than the deadline; past it, a read timeout."""
    deadline = _answer_deadline.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpcore.ReadTimeout(ANSWER_LATE)
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read, of the status line and headers as of the body,
    ends by the deadline."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return self._stream.read(max_bytes, _until_deadline(timeout))
        except httpcore.ReadTimeout:
            _until_deadline(None)  # the deadline's timeout, if it is what ran out
            raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's connections, each a _DeadlineStream."""

    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        """Connected to the first of the host's addresses that answers, its name looked
        up and the connection made within `timeout` together: socket.create_connection,
        which httpcore calls, gives the resolver as long as it takes."""
        started = time.monotonic()
        failed: Exception = httpcore.ConnectError(f"no address found for {host!r}")
        for address in _looked_up(host, port, timeout):
            left = None if timeout is None else timeout - (time.monotonic() - started)
            if left is not None and left <= 0:
                raise httpcore.ConnectTimeout("timed out")
            try:
                stream = self._backend.connect_tcp(
                    address, port, left, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc  # the next address may answer: ::1 refused, 127.0.0.1 not
                continue
            return _DeadlineStream(stream)
        raise failed

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


# Name lookups that may run at once in a process. glibc's getaddrinfo cannot be
# stopped or given a timeout: a lookup the resolver does not answer keeps its thread
# until the resolver gives up (its own timeouts and attempts, resolv.conf), so each
# runs apart and is waited for the request's connect timeout at most.
LOOKUPS_AT_ONCE = 8
_lookup_slots = threading.BoundedSemaphore(LOOKUPS_AT_ONCE)


def _looked_up(host: str, port: int, timeout: float | None) -> list[str]:
    """The host's addresses, in the resolver's order; an IP address is its own."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    unanswered = f"name lookup of {host!r} not answered within the connect timeout"
    started = time.monotonic()
    if not _lookup_slots.acquire(timeout=timeout):
        raise httpcore.ConnectTimeout(f"{unanswered}: {LOOKUPS_AT_ONCE} lookups still wait")
    answer: Future[list[str]] = Future()

    def look_up() -> None:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            answer.set_result(list(dict.fromkeys(str(sockaddr[0]) for *_, sockaddr in found)))
        except OSError as exc:
            answer.set_exception(exc)
        finally:
            _lookup_slots.release()

    threading.Thread(target=look_up, name="outbound-lookup", daemon=True).start()
    try:
        return answer.result(None if timeout is None else timeout - (time.monotonic() - started))
    except TimeoutError:
        raise httpcore.ConnectTimeout(unanswered) from None
    except OSError as exc:  # as httpcore maps socket.create_connection's
        raise httpcore.ConnectError(str(exc)) from exc


def reading_by_deadline(client: httpx.Client) -> httpx.Client:
    """The client, its connections (direct, and through the proxies the environment
    names) read by the deadline, their names looked up within the connect timeout.
    httpx has no timeout for a whole request and takes no network backend, so the
    backend is given to its transports' connection pools (httpx 0.28 and httpcore 1.0,
    pinned in uv.lock: the tests of answers trickled a byte at a time fail if this
    stops reaching them)."""
    for transport in (client._transport, *client._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if isinstance(pool, httpcore.ConnectionPool):
            pool._network_backend = _DeadlineBackend(pool._network_backend)
    return client
