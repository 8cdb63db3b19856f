from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID as EKU
from cryptography.x509.oid import NameOID
from django.contrib.auth.models import Group, User
from django.core.cache import cache
from django.db import connection, connections, transaction
from django.test import Client
from psycopg.pq import TransactionStatus

from ledger import acc
from ledger.capabilities import capability_register, capability_settings_change
from ledger.integrity import verify
from ledger.models import Capability, Runtime, RuntimeToken

ROOT = Path(__file__).resolve().parents[1]

# A log record as settings.LOG_FORMAT writes it, in every process: its time, then this.
LOG_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
LOG_RECORD = re.compile(LOG_TIME + r" level=[A-Z]+ logger=\S+ ")

# The Agent Capability Contract's own files: the schema, the conformance vectors and
# the example OpenAPI documents, beside the project in ../shared/acc/.
SHARED_ACC = Path(
    os.environ.get("ACC_SPEC_DIR", Path(__file__).resolve().parents[2] / "shared" / "acc")
)


@pytest.fixture(autouse=True)
def sweep_logs_afresh(request: pytest.FixtureRequest) -> None:
    """Each test sees the sweep log its refusals, whatever earlier tests' sweeps logged
    (reconciliation.sweeper logs the same refusal again only after a while, remembered
    in the database's cache table, which a transactional test's flush leaves alone)."""
    if request.node.get_closest_marker("django_db") is None:
        # Set up here, before this fixture touches the database, if the test asks for it.
        asked = [name for name in ("transactional_db", "db") if name in request.fixturenames]
        if not asked:
            return
        request.getfixturevalue(asked[0])
    cache.clear()


@pytest.fixture(autouse=True)
def histories_the_policy_explains(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that writes: each history it leaves is one the retry policy
    explains. verify_ledger's replay is checked against every history the services
    write across the suite, and the services against the policy."""
    names = set(request.fixturenames)
    for database in ("transactional_db", "db"):
        if database in names:
            # Asked for here, the database is emptied after this checks it.
            request.getfixturevalue(database)
            break
    else:
        if not request.node.get_closest_marker("django_db"):
            yield
            return
    yield
    if request.node.get_closest_marker("rewrites_history") or in_failed_transaction():
        return
    replayed = [broken for broken in verify().breaks if broken.what == "transition"]
    assert not replayed, "\n".join(map(str, replayed))


def in_failed_transaction() -> bool:
    """A test that showed PostgreSQL refusing a statement leaves its transaction unusable."""
    raw = connection.connection
    return raw is not None and raw.info.transaction_status is TransactionStatus.INERROR


@dataclass
class Api:
    """A runtime's view of the API: JSON in, (status, JSON) out."""

    client: Client
    token: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def post(self, path: str, body: Any, **extra: Any) -> tuple[int, Any]:
        raw = body if isinstance(body, str | bytes) else json.dumps(body)
        response = self.client.post(
            path, raw, content_type="application/json", headers=self.headers(), **extra
        )
        return response.status_code, response.json()

    def get(self, path: str, **params: Any) -> tuple[int, Any]:
        response = self.client.get(path, params, headers=self.headers())
        return response.status_code, response.json()

    def intent(self, **fields: Any) -> tuple[int, Any]:
        return self.post("/api/v1/intents", intent_body(**fields))

    def attempt(self, invocation_id: str, attempt_id: str) -> tuple[int, Any]:
        return self.post(
            f"/api/v1/invocations/{invocation_id}/attempts", {"attempt_id": attempt_id}
        )

    def outcome(self, invocation_id: str, attempt_id: str, **body: Any) -> tuple[int, Any]:
        return self.post(f"/api/v1/invocations/{invocation_id}/attempts/{attempt_id}/outcome", body)


def intent_body(**fields: Any) -> dict[str, Any]:
    body = {
        "invocation_id": "inv-1",
        "task_id": "task-1",
        "capability": "refund.create",
        "arguments": {"order": "SO-1", "amount": "12.50"},
        "idempotency_key": "refund-SO-1",
    }
    body.update(fields)
    return {k: v for k, v in body.items() if v is not None}


@pytest.fixture
def runtime_a(db: None) -> Runtime:
    return Runtime.objects.create(name="runtime-a")


@pytest.fixture
def runtime_b(db: None) -> Runtime:
    return Runtime.objects.create(name="runtime-b")


@pytest.fixture
def api(runtime_a: Runtime) -> Api:
    _, token = RuntimeToken.issue(runtime=runtime_a)
    return Api(Client(), token)


@pytest.fixture
def api_b(runtime_b: Runtime) -> Api:
    _, token = RuntimeToken.issue(runtime=runtime_b)
    return Api(Client(), token)


# Where registered()'s keywords go in an ACC declaration.
DECLARED_AT = {
    "risk_level": ("risk", "level"),
    "readonly": ("execution", "readonly"),
    "idempotent": ("execution", "idempotent"),
    "timeout_ms": ("execution", "timeout_ms"),
    "rate_limit": ("execution", "rate_limit"),
    "subject_required": ("subject", "required"),
    "audit_sensitive": ("audit", "sensitive"),
}


def registered(
    scope: str, *, enabled: bool = True, settings: dict[str, Any] | None = None, **declared: Any
) -> Capability:
    """A capability as the registry makes it: a declaration with these fields
    (risk_level, readonly, ...: DECLARED_AT), then these ledger settings, each recorded
    in the action log, which verification checks capabilities against."""
    raw: dict[str, Any] = {"version": 1, "enabled": enabled, "scope": scope}
    for name, value in declared.items():
        section, key = DECLARED_AT[name]
        raw.setdefault(section, {})[key] = value
    capability_register(declaration=acc.parse(raw), source="tests", actor="user:tests")
    if settings:
        capability_settings_change(
            scope=scope, actor="user:tests", reason="the test's settings", **settings
        )
    return Capability.objects.get(scope=scope)


@pytest.fixture
def refund(db: None) -> Capability:
    """A money-moving write: not readonly, key not verified by the business system."""
    return registered("refund.create", risk_level="high")


@pytest.fixture
def lookup(db: None) -> Capability:
    return registered("order.read", readonly=True, risk_level="low")


def table_counts(counter: str, tables: str) -> dict[str, int]:
    """`counter`, an expression of pg_stat_xact_user_tables' columns, for each table
    whose name is LIKE `tables`: this transaction's own statistics."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT relname, {counter} FROM pg_stat_xact_user_tables WHERE relname LIKE %s",
            [tables],
        )
        return dict(cursor.fetchall())


def invocation_rows_read[T](action: Callable[[], T]) -> tuple[T, int]:
    """What `action` returns, and the invocation rows PostgreSQL read for it, told to
    take any other way it has before reading a table whole, by bitmap, or sorting it:
    the tests' tables are small enough that it would, where a ledger's are not."""
    read = "coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0)"
    with transaction.atomic():
        with connection.cursor() as cursor:
            for way in ("seqscan", "bitmapscan", "sort"):
                cursor.execute(f"SET LOCAL enable_{way} = off")
        before = table_counts(read, "ledger\\_invocation")["ledger_invocation"]
        result = action()
        return result, table_counts(read, "ledger\\_invocation")["ledger_invocation"] - before


def wait_for(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    """Poll until a condition holds: for what another process does in its own time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"not true within {seconds}s: {condition.__doc__ or condition}")


def process_env() -> dict[str, str]:
    """The environment for a process of the project's own on the test database."""
    from ledger.celery import app

    settings = connection.settings_dict
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": f"postgresql://{settings['USER']}@{settings['HOST']}:"
        f"{settings['PORT'] or 5432}/{settings['NAME']}",
        "CELERY_BROKER_URL": app.conf.broker_url,
    }


@pytest.fixture
def web_processes(transactional_db: None) -> Iterator[list[str]]:
    """Two gunicorn servers of one worker each on the test database: their URLs."""
    servers: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for _ in range(2):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            process = subprocess.Popen(
                [sys.executable, "-m", "gunicorn", "ledger.wsgi", "--bind", f"127.0.0.1:{port}",
                 "--workers", "1", "--log-level", "warning"],
                cwd=ROOT, env={**process_env(), "LOG_LEVEL": "WARNING"},
            )  # fmt: skip
            servers.append((f"http://127.0.0.1:{port}", process))
        for url, _ in servers:
            wait_for(functools.partial(answers_200, f"{url}/healthz"))
        yield [url for url, _ in servers]
    finally:
        for _, process in servers:
            process.terminate()
            process.wait(timeout=20)


def answers_200(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """The SQL statements the requests in the test send, in order.

    Savepoints are left out: they exist because the test runs in a transaction.
    """
    sent: list[str] = []

    def record(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if not sql.startswith(("SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO SAVEPOINT")):
            sent.append(sql)
        return execute(sql, *args)

    with connection.execute_wrapper(record):
        yield sent


@pytest.fixture
def unreachable_database() -> Iterator[None]:
    """Point the app's connection at a port where nothing listens."""
    saved = dict(connection.settings_dict)
    connections.close_all()
    if hasattr(connection, "close_pool"):
        connection.close_pool()
    connection.settings_dict.update(HOST="127.0.0.1", PORT="9")
    try:
        yield
    finally:
        connection.close()
        if hasattr(connection, "close_pool"):
            connection.close_pool()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


def person(name: str, *groups: str) -> Client:
    """A console user in those roles (groups), logged in."""
    user = User.objects.create_user(name, password="pw")
    for group in groups:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    client = Client()
    client.force_login(user)
    return client


@contextmanager
def served(server: ThreadingHTTPServer) -> Iterator[None]:
    """The server answering, in a thread of its own, until the block ends."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def answer(
    handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str = ""
) -> None:
    handler.send_response(status)
    if content_type:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@dataclass
class AnchorStore:
    """A log store that takes what it is sent: each request's headers and body, and
    its answer (`status`, then a receipt naming the record)."""

    url: str
    received: list[tuple[dict[str, str], Any]] = field(default_factory=list)
    status: int = 201
    # "receipt"; "trickled", its status line and headers a byte every TRICKLE_SECONDS;
    # or "long", 8 MiB of receipt without a Content-Length.
    answering: str = "receipt"
    LONG_BYTES = 8 * 1024 * 1024
    # The fault a trickling store is, as the stand-in's trickle modes: the pause between
    # the bytes it sends (not a wait for anything to happen).
    TRICKLE_SECONDS = 0.05


@contextmanager
def serving_anchor_store(tls: ssl.SSLContext | None = None) -> Iterator[AnchorStore]:
    """An AnchorStore listening on 127.0.0.1, over https with `tls`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    scheme = "https" if tls else "http"
    taken = AnchorStore(f"{scheme}://127.0.0.1:{server.server_address[1]}/anchors")

    class Takes(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            taken.received.append((dict(self.headers), body))
            receipt = f"record-{len(taken.received)}".encode()
            if taken.answering == "receipt":
                answer(self, taken.status, receipt)
                return
            with contextlib.suppress(OSError):  # the ledger hung up, as it should
                self.answer_unusually(receipt)

        def answer_unusually(self, receipt: bytes) -> None:
            if taken.answering == "trickled":
                for byte in b"HTTP/1.1 201 Created\r\nContent-Length: 8\r\n\r\n":
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(taken.TRICKLE_SECONDS)
                self.wfile.write(receipt)
                return
            self.send_response(taken.status)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(taken.LONG_BYTES // len(receipt)):
                self.wfile.write(receipt)

    server.RequestHandlerClass = Takes
    with served(server):
        yield taken


@pytest.fixture
def anchor_store() -> Iterator[AnchorStore]:
    with serving_anchor_store() as store:
        yield store


# A time-stamping authority (RFC 3161) --------------------------------------------------

OPENSSL = "/usr/bin/openssl"  # Debian's, as on every machine of this project's kind


@dataclass
class TimestampAuthority:
    """A time-stamping authority served by `openssl ts -reply`, under a root of its own
    (`roots`, the PEM file a ledger checks its tokens against)."""

    url: str
    roots: Path
    # The message digests it signs; a request for another is answered with a refusal.
    digests: str = "sha256"
    queries: int = 0


def certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None = None,
    signer: ec.EllipticCurvePrivateKey | None = None,
) -> x509.Certificate:  # fmt: skip
    """A root certificate, or one for a time-stamping unit that `issuer` signs."""
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    built = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
    )
    if issuer is None:
        built = built.add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
    else:
        built = built.add_extension(x509.ExtendedKeyUsage([EKU.TIME_STAMPING]), critical=True)
    return built.sign(signer or key, hashes.SHA256())


def pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


@contextmanager
def serving_authority(directory: Path) -> Iterator[TimestampAuthority]:
    directory.mkdir()
    root_key, unit_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    root = certificate("Test TSA root", root_key)
    (directory / "root.pem").write_bytes(pem(root))
    (directory / "unit.pem").write_bytes(pem(certificate("Test TSA", unit_key, root, root_key)))
    (directory / "unit.key").write_bytes(
        unit_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (directory / "serial").write_text("01\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    authority = TimestampAuthority(
        f"http://127.0.0.1:{server.server_address[1]}/tsa", directory / "root.pem"
    )

    class Signs(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            authority.queries += 1
            query = directory / f"query-{authority.queries}.tsq"
            query.write_bytes(self.rfile.read(int(self.headers["Content-Length"])))
            (directory / "ts.cnf").write_text(
                "[ tsa ]\ndefault_tsa = unit\n[ unit ]\n"
                f"serial = {directory / 'serial'}\nsigner_digest = sha256\n"
                f"default_policy = 1.2.3.4.1\ndigests = {authority.digests}\n"
                "accuracy = secs:1\ness_cert_id_alg = sha256\n"
            )
            reply = subprocess.run(
                [OPENSSL, "ts", "-reply", "-config", directory / "ts.cnf",
                 "-queryfile", query, "-signer", directory / "unit.pem",
                 "-inkey", directory / "unit.key"],
                capture_output=True, check=True, timeout=30,
            ).stdout  # fmt: skip
            answer(self, 200, reply, "application/timestamp-reply")

    server.RequestHandlerClass = Signs
    with served(server):
        yield authority


@pytest.fixture
def authority(tmp_path: Path, settings: Any) -> Iterator[TimestampAuthority]:
    with serving_authority(tmp_path / "tsa") as serving:
        settings.LEDGER_ANCHOR_URL = serving.url
        settings.LEDGER_ANCHOR_PROTOCOL = "rfc3161"
        settings.LEDGER_ANCHOR_TSA_ROOTS = str(serving.roots)
        yield serving
