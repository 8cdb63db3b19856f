from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ledger.client.spool import Record, Spool
from ledger.models import Capability, Runtime, RuntimeToken

# Real workers and the stand-in, as reconciliation's tests use them.
from tests.reconciliation.conftest import standin, workers  # noqa: F401


class TcpProxy:
    """A port in front of the live server that a test can take down and bring back."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.listener: socket.socket | None = None
        self.connections: list[socket.socket] = []
        # The next answer is dropped and its connection closed, as a web process killed
        # after the ledger recorded the request, before it answered, would leave it.
        self.cutting = threading.Event()
        self.answers_cut = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self.listener:
            # shutdown wakes the thread blocked in accept(); close alone would not.
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
            self.listener = None
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self.connections.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.connections += [client, upstream]
            for a, b, answers in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, answers), daemon=True).start()

    def cut_next_answer(self) -> None:
        self.cutting.set()

    def _pipe(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(65536):
                if answers and self.cutting.is_set():
                    self.cutting.clear()
                    self.answers_cut += 1
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def token(transactional_db: None) -> str:
    Capability.objects.create(scope="refund.create", risk_level="medium")
    _, token = RuntimeToken.issue(runtime=Runtime.objects.create(name="client-tests"))
    return token


@pytest.fixture
def proxy(live_server: Any) -> Iterator[TcpProxy]:
    host, port = live_server.url.removeprefix("http://").split(":")
    proxy = TcpProxy((host, int(port))).start()
    try:
        yield proxy
    finally:
        proxy.stop()


class SlowDeliveries:
    """A spool holding one record, whose deliveries are counted, each held up by a slow
    disk long enough for the calls around it to end meanwhile."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.spool = Spool(path)
        self.spool.append(Record("/api/v1/invocations/inv-x/attempts/a1/outcome", {"kind": "won"}))
        self.count = 0
        deliver = Spool.deliver

        def slow_delivery(spool: Spool, *args: Any) -> Any:
            self.count += 1
            time.sleep(0.5)  # fault pause: the slow disk
            return deliver(spool, *args)

        monkeypatch.setattr(Spool, "deliver", slow_delivery)


@pytest.fixture
def slow_deliveries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SlowDeliveries:
    return SlowDeliveries(tmp_path / "spool.jsonl", monkeypatch)
