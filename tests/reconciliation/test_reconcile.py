"""Reconciliation without a worker: claims, probes, results, people."""

from __future__ import annotations

import datetime as dt
import email.utils
import gzip
import hashlib
import importlib
import json
import socket
import ssl
import threading
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import trustme
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from ledger import metrics, outbound, policy
from ledger.models import Capability, Invocation, NamedReference
from ledger.probe_config import problems
from ledger.services import LedgerError, flag_missing_evidence
from reconciliation import probes, services, sweeper
from reconciliation.standin import (
    HUGE_BYTES,
    NO_REFUND,
    RETRY_AFTER,
    StandInService,
    gzip_bomb_start,
)
from reconciliation.tasks import reconcile_invocation, worker_name
from tests.conftest import Api, person, wait_for
from tests.ledger.test_metrics import samples
from tests.reconciliation.conftest import perform_refund


def flagged(api: Api, invocation_id: str = "inv-1", key: str = "refund-SO-1") -> Invocation:
    api.intent(invocation_id=invocation_id, idempotency_key=key, attempt_id="a1")
    deadline = Invocation.objects.get(invocation_id=invocation_id).deadline_at
    assert deadline is not None
    assert flag_missing_evidence(invocation_id=invocation_id, now=deadline)
    return Invocation.objects.get(invocation_id=invocation_id)


def events(invocation_id: str = "inv-1") -> list[str]:
    invocation = Invocation.objects.get(invocation_id=invocation_id)
    return list(invocation.events.order_by("seq").values_list("kind", flat=True))


def test_a_refund_that_happened_is_found_and_the_invocation_succeeds(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    flagged(api)
    refund = perform_refund(standin, "refund-SO-1").json()
    assert reconcile_invocation.run("inv-1") == "recorded"
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.cause) == ("succeeded", "reconciled_effect_present")
    probe_run = invocation.events.get(kind="probe_run").data
    assert (probe_run["finding"], probe_run["business_reference"]) == (
        "effect_present",
        refund["id"],
    )
    assert probe_run["request"]["url"].endswith("idempotency_key=refund-SO-1")
    # The rule as it decided, and the answer it read by its digest (the body not kept).
    assert probe_run["request"]["rule"] == {"name": "present", **refunds.probe["present"]}
    answer = httpx.get(f"{standin.url}/refunds", params={"idempotency_key": "refund-SO-1"})
    assert probe_run["request"]["answer"] == {
        "bytes": len(answer.content),
        "sha256": hashlib.sha256(answer.content).hexdigest(),
    }
    assert standin.refunds.count() == 1


def test_a_refund_another_invocation_names_is_handed_to_a_person_to_confirm(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """The business system answers the key with a refund whose id inv-2's outcome
    already named: the probe cannot tell one effect counted twice from a mistake."""
    flagged(api)
    refund = perform_refund(standin, "refund-SO-1").json()
    api.intent(invocation_id="inv-2", idempotency_key="refund-SO-2", attempt_id="a1")
    api.outcome("inv-2", "a1", kind="succeeded", business_reference=refund["id"])

    reconcile_invocation.run("inv-1")

    invocation = Invocation.objects.get(invocation_id="inv-1")
    assert (invocation.status, invocation.cause) == ("escalated", "reference_shared")
    assert invocation.flags == ["reference_shared"]
    probe_run = invocation.events.get(kind="probe_run").data
    assert (probe_run["finding"], probe_run["also_named_by"]) == ("effect_present", ["inv-2"])
    services.invocation_resolve(
        invocation_id="inv-1",
        actor="user:ada",
        effect=policy.Effect.PRESENT,
        business_reference=refund["id"],
        note="one refund for two orders, as the customer asked",
        shared_reference_confirmed=True,
    )
    assert Invocation.objects.get(invocation_id="inv-1").status == "succeeded"


def test_a_refund_that_never_happened_allows_a_retry_under_the_same_key(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    flagged(api)
    assert api.attempt("inv-1", "a2")[1]["error"]["type"] == "attempt_refused"
    reconcile_invocation.run("inv-1")
    assert Invocation.objects.get().status == "retry_allowed"
    status, body = api.attempt("inv-1", "a2")
    assert (status, body["status"]) == (201, "in_flight")
    perform_refund(standin, "refund-SO-1")
    assert api.outcome("inv-1", "a2", kind="succeeded")[1]["status"] == "succeeded"
    assert standin.refunds.count() == 1


@pytest.mark.parametrize("mode", ["5xx", "malformed", "redirect"])
@override_settings(LEDGER_PROBE_MAX_TRIES=3, LEDGER_PROBE_BACKOFF_SECONDS=10)
def test_unclear_answers_are_inconclusive_back_off_then_escalate(
    api: Api, refunds: Capability, standin: StandInService, mode: str
) -> None:
    flagged(api)
    perform_refund(standin, "refund-SO-1")  # it did happen; the probe cannot tell
    standin.refunds.set_mode(mode)
    now = timezone.now()
    delays = []
    for _ in range(3):
        assert services.invocation_claim(invocation_id="inv-1", worker="w", now=now)
        invocation = Invocation.objects.get()
        result = probes.run(refunds.probe, invocation)
        assert result is not None and result.finding is probes.Finding.INCONCLUSIVE
        services.record_probe_result(invocation_id="inv-1", worker="w", result=result, now=now)
        invocation = Invocation.objects.get()
        if invocation.next_probe_at:
            delays.append((invocation.next_probe_at - now).total_seconds())
            # Not before the backoff has passed.
            assert services.invocation_claim(invocation_id="inv-1", worker="w", now=now) is None
            now = invocation.next_probe_at
    assert delays == [10, 20]
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.cause) == ("escalated", "probe_inconclusive")
    assert invocation.resolution == ""  # never a false effect_absent


@override_settings(LEDGER_PROBE_MAX_TRIES=3, LEDGER_PROBE_BACKOFF_SECONDS=5)
def test_a_business_system_asking_to_wait_is_asked_again_no_sooner(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """A 429 with Retry-After: 30 puts the next probe off 30 s, not the backoff's 5 s,
    so a business system throttling a burst of re-probes does not use up their tries."""
    flagged(api)
    standin.refunds.set_mode("429")
    now = timezone.now()
    assert services.invocation_claim(invocation_id="inv-1", worker="w", now=now)
    result = probes.run(refunds.probe, Invocation.objects.get())
    assert result is not None and result.retry_after == RETRY_AFTER
    services.record_probe_result(invocation_id="inv-1", worker="w", result=result, now=now)
    invocation = Invocation.objects.get()
    assert invocation.next_probe_at == now + dt.timedelta(seconds=RETRY_AFTER)
    assert invocation.events.get(kind="probe_run").data["retry_after"] == RETRY_AFTER


@pytest.mark.parametrize(
    ("status", "header", "seconds"),
    [
        (503, "120", 120.0),
        (429, "86400", probes.RETRY_AFTER_MAX_SECONDS),  # a day: an hour at most
        (429, "in a while", 0.0),
        (429, "Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # a date gone by
        (404, "30", 0.0),  # only a 429 or a 503 asks to wait
    ],
)
def test_retry_after_is_read_as_seconds_or_a_date_and_bounded(
    status: int, header: str, seconds: float
) -> None:
    response = httpx.Response(status, headers={"Retry-After": header})
    assert probes.retry_after_of(response) == seconds


def test_retry_after_as_a_date_to_come_is_the_seconds_until_it() -> None:
    when = timezone.now() + dt.timedelta(seconds=90)
    response = httpx.Response(
        429, headers={"Retry-After": email.utils.format_datetime(when, usegmt=True)}
    )
    assert 80 <= probes.retry_after_of(response) <= 90


def test_a_probe_that_times_out_or_cannot_connect_is_inconclusive(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    invocation = flagged(api)
    standin.refunds.set_mode("slow")
    slow = probes.run({**refunds.probe, "read_timeout": 0.3}, invocation)
    refused = probes.run({**refunds.probe, "url": "http://127.0.0.1:9/refunds"}, invocation)
    for result in (slow, refused):
        assert result is not None and result.finding is probes.Finding.INCONCLUSIVE
    assert refused is not None and refused.detail == "ConnectError: [Errno 111] Connection refused"
    assert slow is not None and slow.detail == "ReadTimeout: timed out"


@pytest.mark.parametrize(
    ("mode", "detail"),
    [
        ("trickle", f"ReadTimeout: {outbound.ANSWER_LATE}"),
        ("huge", f"answer of {HUGE_BYTES} bytes, over {outbound.ANSWER_MAX_BYTES}"),
        ("endless", f"answer over {outbound.ANSWER_MAX_BYTES} bytes"),
    ],
)
def test_an_answer_too_slow_to_finish_or_too_long_is_inconclusive_unread(
    api: Api, refunds: Capability, standin: StandInService, mode: str, detail: str
) -> None:
    """The read timeout bounds each read, not the answer: a business system sending a
    byte at a time would hold a worker's thread for as long as it liked, and a body
    without end would fill its memory. The refund happened, and the trickled and huge
    answers, read whole, would say so."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    standin.refunds.set_mode(mode)
    result = probes.run(refunds.probe, invocation)
    assert result is not None
    assert (result.finding, result.detail) == (probes.Finding.INCONCLUSIVE, detail)
    assert result.summary["status"] == 200


def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_probes_deadline(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """httpx's read timeout bounds each read of the status line and headers too: sent
    a byte every 0.2 s, the stand-in's head would take 16 s, and before the answer's
    body was read nothing looked at the probe's deadline. Now the probe hangs up at it
    (1 s), before the head is sent."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    standin.refunds.set_mode("trickle_head")
    config = {**refunds.probe, "connect_timeout": 0.5, "read_timeout": 0.5}
    result = probes.run(config, invocation)
    assert result is not None
    assert (result.finding, result.detail) == (
        probes.Finding.INCONCLUSIVE,
        f"ReadTimeout: {outbound.ANSWER_LATE}",
    )
    wait_for(lambda: standin.refunds.heads_cut == 1)


def test_a_probe_through_the_proxy_the_environment_names_keeps_its_deadline_too(
    api: Api, refunds: Capability, standin: StandInService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes go through HTTP_PROXY, as httpx's requests do, on connections of their
    own: the stand-in, as that proxy, answers the request for the business system
    itself, its head a byte at a time."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    standin.refunds.set_mode("trickle_head")
    for name in ("http_proxy", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", standin.url)
    config = {
        **refunds.probe,
        "url": "http://payments.invalid/refunds?idempotency_key={idempotency_key}",
        "connect_timeout": 0.5,
        "read_timeout": 0.5,
    }
    # A thread's first probe builds its client, which reads the environment then.
    results: list[probes.ProbeResult | None] = []
    asking = threading.Thread(target=lambda: results.append(probes.run(config, invocation)))
    asking.start()
    asking.join()
    assert [(r and r.finding, r and r.detail) for r in results] == [
        (probes.Finding.INCONCLUSIVE, f"ReadTimeout: {outbound.ANSWER_LATE}")
    ]
    wait_for(lambda: standin.refunds.heads_cut == 1)


class Resolver:
    """The system resolver, for the business system's name (payments.ledger-test): its
    addresses, once `answering` is set."""

    NAME = "payments.ledger-test"

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *addresses: str) -> None:
        self.addresses = addresses
        self.answering = threading.Event()
        self.real = socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", self.getaddrinfo)

    def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != self.NAME:
            return self.real(host, port, *args, **kwargs)
        self.answering.wait(timeout=5)  # as a resolver's own timeout would end it
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))
            for address in self.addresses
        ]


def asked_by_name(standin: StandInService, invocation: Invocation) -> probes.ProbeResult:
    """The stand-in's probe, asking by the business system's name (connect timeout
    0.5 s)."""
    port = standin.server.server_address[1]
    url = f"http://{Resolver.NAME}:{port}/refunds?idempotency_key={{idempotency_key}}"
    result = probes.run({**standin.probe_config(), "url": url, "connect_timeout": 0.5}, invocation)
    assert result is not None
    return result


def test_a_name_the_resolver_does_not_answer_is_given_the_connect_timeout(
    api: Api, refunds: Capability, standin: StandInService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """socket.create_connection, which httpx's connections call, waits for the resolver
    as long as it takes (here 5 s, glibc's default timeout; 30 s and more with several
    name servers and attempts). The lookup is the connection's first step: the connect
    timeout bounds it. The refund happened, and the answer, once looked up, says so."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    resolver = Resolver(monkeypatch, "127.0.0.1")
    result = asked_by_name(standin, invocation)
    assert (result.finding, result.detail) == (
        probes.Finding.INCONCLUSIVE,
        f"ConnectTimeout: name lookup of {Resolver.NAME!r} not answered within the connect timeout",
    )
    resolver.answering.set()
    assert asked_by_name(standin, invocation).finding is probes.Finding.PRESENT


def test_lookups_left_unanswered_are_counted_not_a_thread_each_without_end(
    api: Api, refunds: Capability, standin: StandInService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup the resolver leaves unanswered keeps its thread, as getaddrinfo cannot
    be stopped; a worker's (here one) all waiting, the next probe does not start one."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    monkeypatch.setattr(outbound, "LOOKUPS_AT_ONCE", 1)
    monkeypatch.setattr(outbound, "_lookup_slots", threading.BoundedSemaphore(1))
    resolver = Resolver(monkeypatch, "127.0.0.1")
    details = [asked_by_name(standin, invocation).detail for _ in "12"]
    unanswered = f"name lookup of {Resolver.NAME!r} not answered within the connect timeout"
    assert details == [
        f"ConnectTimeout: {unanswered}",
        f"ConnectTimeout: {unanswered}: 1 lookups still wait",
    ]
    resolver.answering.set()
    wait_for(lambda: outbound._lookup_slots.acquire(blocking=False))
    outbound._lookup_slots.release()
    assert asked_by_name(standin, invocation).finding is probes.Finding.PRESENT


def test_a_name_is_tried_at_each_of_its_addresses_in_turn(
    api: Api, refunds: Capability, standin: StandInService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As socket.create_connection does: a name's first address refusing (the business
    system's IPv6 address, say, where it does not listen) is not the probe's answer."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    Resolver(monkeypatch, "127.0.0.2", "127.0.0.1").answering.set()
    assert asked_by_name(standin, invocation).finding is probes.Finding.PRESENT
    Resolver(monkeypatch, "127.0.0.2").answering.set()
    refused = asked_by_name(standin, invocation)
    assert refused.detail == "ConnectError: [Errno 111] Connection refused"


@pytest.mark.parametrize("mode", ["gzip", "deflate", "deflate_raw"])
def test_a_compressed_answer_is_read(
    api: Api, refunds: Capability, standin: StandInService, mode: str
) -> None:
    """A business system behind a web server with compression on answers in gzip or
    deflate (some send deflate without its zlib header): a found refund and a missing
    one are both read."""
    found, missing = flagged(api), flagged(api, "inv-2", "refund-SO-2")
    refund = perform_refund(standin, "refund-SO-1").json()
    standin.refunds.set_mode(mode)
    results = [probes.run(refunds.probe, invocation) for invocation in (found, missing)]
    assert [(r and r.finding, r and r.business_reference) for r in results] == [
        (probes.Finding.PRESENT, refund["id"]),
        (probes.Finding.ABSENT, ""),
    ]
    assert standin.refunds.encodings_sent == ["deflate" if mode == "deflate_raw" else mode] * 2


def test_a_gzip_bomb_is_inconclusive_and_never_inflated_whole(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """64 MiB of whitespace before the found refund, in 64 KiB of gzip: read whole it would
    say found. The probe stops at ANSWER_MAX_BYTES without holding much more than that."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    standin.refunds.set_mode("gzip_bomb")
    gzip_bomb_start()  # built before memory is traced
    tracemalloc.start()
    try:
        result = probes.run(refunds.probe, invocation)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result is not None
    assert (result.finding, result.detail) == (
        probes.Finding.INCONCLUSIVE,
        f"answer over {outbound.ANSWER_MAX_BYTES} bytes",
    )
    assert standin.refunds.encodings_sent == ["gzip"]
    assert peak < 4 * outbound.ANSWER_MAX_BYTES


def test_an_answer_in_an_encoding_a_probe_does_not_read_is_inconclusive(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """gzip twice over: httpx would undo both, each layer inflating a whole read at once.
    The probe asked for one layer of gzip or deflate and reads nothing else."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    standin.refunds.set_mode("stacked")
    result = probes.run(refunds.probe, invocation)
    assert result is not None
    assert (result.finding, result.detail) == (
        probes.Finding.INCONCLUSIVE,
        "answer encoded as 'gzip, gzip'; the ledger reads gzip, deflate",
    )


def test_a_compressed_answer_cut_short_is_unread() -> None:
    """A connection closed midway through a gzip answer, its length undeclared."""
    whole = gzip.compress(json.dumps({"status": "succeeded", "id": "re_1"}).encode())
    cut = httpx.Response(
        200, headers={"Content-Encoding": "gzip"}, stream=httpx.ByteStream(whole[:-8])
    )
    with pytest.raises(outbound.UnreadAnswer, match="answer's gzip stream ends early"):
        outbound.read_answer(cut)
    read = outbound.read_answer(
        httpx.Response(200, headers={"Content-Encoding": "gzip"}, stream=httpx.ByteStream(whole))
    )
    assert json.loads(read)["id"] == "re_1"


def test_a_404_that_is_not_the_business_systems_no_such_refund_is_not_absent(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """ "Absent" lets the runtime retry the refund. A mistyped or moved URL is answered
    404 by whatever routes it, and the refund did happen: taken for "absent", every
    flagged refund would be made twice."""
    invocation = flagged(api)
    perform_refund(standin, "refund-SO-1")
    mistyped = {**refunds.probe, "url": refunds.probe["url"].replace("/refunds?", "/refund?")}
    result = probes.run(mistyped, invocation)
    assert result is not None
    assert (result.finding, result.detail) == (
        probes.Finding.INCONCLUSIVE,
        "no rule matched status 404",
    )
    # A probe saved before its absent rule had to name the answer concludes nothing
    # from any 404, however its URL is spelled: a person decides.
    bare = {**mistyped, "absent": {"status": 404}}
    Capability.objects.filter(pk=refunds.pk).update(probe=bare)
    assert reconcile_invocation.run("inv-1") == "recorded"
    invocation = Invocation.objects.get()
    assert invocation.status == "reconciliation_required"
    probe_run = invocation.events.get(kind="probe_run").data
    assert probe_run["finding"] == "inconclusive"
    assert probe_run["detail"].startswith("misconfigured: absent: needs 'json_path' and 'equals'")
    compliance = person("cora", "compliance")
    its_page = compliance.get("/audit/capabilities/refund.create/").content.decode()
    assert (
        '<ul class="errorlist" id="probe-problems"><li>absent: needs &#x27;json_path&#x27; and'
    ) in its_page
    dashboard = compliance.get("/dashboard/").content.decode()
    assert (
        'so that a person decides each of their invocations: <a href="/audit/capabilities/'
        'refund.create/">refund.create</a> (absent).</p>'
    ) in dashboard
    alerted = samples(metrics.exposition())
    concluding_nothing = ("capability", "refund.create"), ("rule", "absent")
    assert alerted[("ledger_probes_concluding_nothing", concluding_nothing)] == 1


def test_a_200_that_is_not_the_refund_is_not_present(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """ "Present" settles the invocation as succeeded. A status alone would take any 200
    for the refund: here the service's statistics, asked by a probe pointed at the wrong
    page. No refund was made."""
    invocation = flagged(api)
    stats = {**refunds.probe, "url": f"{standin.url}/stats?key={{idempotency_key}}"}
    result = probes.run(stats, invocation)
    assert result is not None
    assert (result.finding, result.detail) == (
        probes.Finding.INCONCLUSIVE,
        "no rule matched status 200",
    )
    result = probes.run({**stats, "present": {"status": 200}}, invocation)
    assert result is not None
    assert result.finding is probes.Finding.INCONCLUSIVE
    assert result.detail.startswith("misconfigured: present: needs 'json_path' or")


def test_a_search_answering_200_either_way_is_read_by_its_paths(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """A search API answers 200 with a list, empty when nothing has the key: the present
    rule's path is missing from the empty list, and the absent rule reads it."""
    found, missing = flagged(api), flagged(api, "inv-2", "refund-SO-2")
    refund = perform_refund(standin, "refund-SO-1").json()
    search = {
        "kind": "http",
        "url": f"{standin.url}/refunds/search?idempotency_key={{idempotency_key}}",
        "present": {
            "status": 200,
            "json_path": "data.0.status",
            "equals": "succeeded",
            "reference_path": "data.0.id",
        },
        "absent": {"status": 200, "json_path": "data", "equals": []},
    }
    assert problems(search) == []
    results = [probes.run(search, invocation) for invocation in (found, missing)]
    assert [(r and r.finding, r and r.business_reference) for r in results] == [
        (probes.Finding.PRESENT, refund["id"]),
        (probes.Finding.ABSENT, ""),
    ]


@dataclass
class CompanyCA:
    """A company's own CA (trustme's), its certificate in `ca_file`, and the payments
    stand-in served over https with a certificate it signed."""

    ca: trustme.CA
    ca_file: str
    tls: ssl.SSLContext

    @contextmanager
    def payments(self, tmp_path: Path) -> Iterator[StandInService]:
        """The payments stand-in, served over https with this CA's certificate."""
        payments = StandInService(tmp_path / "payments.sqlite3", tls=self.tls).start()
        try:
            yield payments
        finally:
            payments.stop()

    def requiring_client_certificates(self) -> None:
        """The business system lets in only clients whose certificate this CA signed."""
        self.ca.configure_trust(self.tls)
        self.tls.verify_mode = ssl.CERT_REQUIRED


def client_certificate(ca: trustme.CA, path: Path) -> str:
    """A client certificate `ca` signed, with its key, written to `path` as a renewal
    writes one: whole beside it, then moved into place."""
    written = path.with_suffix(".new")
    ca.issue_cert("ledger-probes").private_key_and_cert_chain_pem.write_to_path(str(written))
    written.replace(path)
    return str(path)


@pytest.fixture
def company_ca(tmp_path: Path) -> CompanyCA:
    ca = trustme.CA()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(tls)
    ca.cert_pem.write_to_path(str(tmp_path / "company-ca.pem"))
    return CompanyCA(ca, str(tmp_path / "company-ca.pem"), tls)


def asked_at(payments: StandInService, refunds: Capability) -> dict[str, Any]:
    return {**refunds.probe, "url": f"{payments.url}/refunds?idempotency_key={{idempotency_key}}"}


def test_an_https_probe_trusts_the_companys_own_ca_when_named(
    api: Api, refunds: Capability, tmp_path: Path, company_ca: CompanyCA
) -> None:
    """A business system whose certificate the company's own CA signed: unverified (and
    so inconclusive) until LEDGER_PROBE_CA_FILE names that CA, then read; a CA file
    that cannot be read is a misconfiguration, named."""
    with company_ca.payments(tmp_path) as payments:
        invocation = flagged(api)
        config = asked_at(payments, refunds)
        assert config["url"].startswith("https://127.0.0.1:")
        unverified = probes.run(config, invocation)
        with override_settings(LEDGER_PROBE_CA_FILE=company_ca.ca_file):
            trusted = probes.run(config, invocation)
        with (
            override_settings(LEDGER_PROBE_CA_FILE=str(tmp_path / "missing.pem")),
            pytest.raises(probes.ProbeConfigError, match=r"LEDGER_PROBE_CA_FILE '.*missing\.pem'"),
        ):
            probes.run(config, invocation)
    assert unverified is not None and trusted is not None
    assert unverified.finding is probes.Finding.INCONCLUSIVE
    assert unverified.detail.startswith("ConnectError: [SSL: CERTIFICATE_VERIFY_FAILED]")
    assert trusted.finding is probes.Finding.ABSENT  # asked over TLS, and answered


def test_an_https_probe_shows_its_certificate_to_a_business_system_that_asks(
    api: Api, refunds: Capability, tmp_path: Path, company_ca: CompanyCA
) -> None:
    """Mutual TLS: the business system lets in only a client whose certificate the
    company's CA signed. Without LEDGER_PROBE_CLIENT_CERT the probe is turned away
    (inconclusive, never "absent"); with it, it is answered."""
    company_ca.requiring_client_certificates()
    client_cert = client_certificate(company_ca.ca, tmp_path / "probes.pem")
    with company_ca.payments(tmp_path) as payments:
        invocation = flagged(api)
        config = asked_at(payments, refunds)
        with override_settings(LEDGER_PROBE_CA_FILE=company_ca.ca_file):
            turned_away = probes.run(config, invocation)
            with override_settings(LEDGER_PROBE_CLIENT_CERT=client_cert):
                let_in = probes.run(config, invocation)
            with (
                override_settings(LEDGER_PROBE_CLIENT_CERT=company_ca.ca_file),
                pytest.raises(probes.ProbeConfigError, match="LEDGER_PROBE_CLIENT_CERT"),
            ):
                probes.run(config, invocation)  # a certificate without its key
    assert turned_away is not None and let_in is not None
    assert turned_away.finding is probes.Finding.INCONCLUSIVE
    assert let_in.finding is probes.Finding.ABSENT


def test_each_business_system_is_shown_its_own_certificate(
    api: Api, refunds: Capability, tmp_path: Path, company_ca: CompanyCA
) -> None:
    """Business systems with a CA, and a client certificate for the ledger, of their
    own: a probe with `"tls": "PAYMENTS"` trusts LEDGER_PROBE_CA_FILE_PAYMENTS and shows
    LEDGER_PROBE_CLIENT_CERT_PAYMENTS instead of LEDGER_PROBE_CLIENT_CERT (another
    system's); probes that do not name it neither trust nor show them. A name the
    settings lack is a misconfiguration, named."""
    company_ca.requiring_client_certificates()
    named = {
        "LEDGER_PROBE_CA_FILES": {"PAYMENTS": company_ca.ca_file},
        "LEDGER_PROBE_CLIENT_CERTS": {
            "PAYMENTS": client_certificate(company_ca.ca, tmp_path / "payments-client.pem")
        },
        "LEDGER_PROBE_CLIENT_CERT": client_certificate(
            trustme.CA(), tmp_path / "hr-client.pem"
        ),  # the HR system's
    }
    with company_ca.payments(tmp_path) as payments:
        invocation = flagged(api)
        config = asked_at(payments, refunds)
        with override_settings(**named):
            unnamed = probes.run(config, invocation)
            with override_settings(LEDGER_PROBE_CA_FILE=company_ca.ca_file):
                shown_the_other = probes.run(config, invocation)
            own = probes.run({**config, "tls": "PAYMENTS"}, invocation)
            with pytest.raises(
                probes.ProbeConfigError,
                match="tls 'HR' is not configured: set LEDGER_PROBE_CA_FILE_HR or "
                "LEDGER_PROBE_CLIENT_CERT_HR",
            ):
                probes.run({**config, "tls": "HR"}, invocation)
    assert unnamed is not None and shown_the_other is not None and own is not None
    assert unnamed.detail.startswith("ConnectError: [SSL: CERTIFICATE_VERIFY_FAILED]")
    assert shown_the_other.finding is probes.Finding.INCONCLUSIVE
    assert "CERTIFICATE_VERIFY_FAILED" not in shown_the_other.detail  # trusted, turned away
    assert own.finding is probes.Finding.ABSENT


def test_a_client_certificate_renewed_in_place_is_shown_at_the_next_probe(
    api: Api, refunds: Capability, tmp_path: Path, company_ca: CompanyCA
) -> None:
    """Certificates are renewed where they lie (a file replaced, a mounted secret
    updated) while the workers run: the next probe reads the new one, where a worker's
    client kept the one it first read until it was restarted."""
    company_ca.requiring_client_certificates()
    client_cert = tmp_path / "probes.pem"
    client_certificate(trustme.CA(), client_cert)  # another CA's: not let in
    with company_ca.payments(tmp_path) as payments:
        invocation = flagged(api)
        config = asked_at(payments, refunds)
        tls = {"LEDGER_PROBE_CA_FILE": company_ca.ca_file, "LEDGER_PROBE_CLIENT_CERT": client_cert}
        with override_settings(**tls):
            before = probes.run(config, invocation)
            client_certificate(company_ca.ca, client_cert)  # renewed by the company's CA
            after = probes.run(config, invocation)
    assert before is not None and after is not None
    assert before.finding is probes.Finding.INCONCLUSIVE
    assert after.finding is probes.Finding.ABSENT


def test_a_probe_by_business_reference_asks_nothing_of_an_invocation_without_one(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    """Its URL filled with an empty reference would ask about nothing in particular
    (`/refunds?idempotency_key=`), and a 404 for that is no answer about this refund."""
    invocation = flagged(api)
    by_reference = f"{standin.url}/refunds?idempotency_key={{business_reference}}"
    result = probes.run({**refunds.probe, "url": by_reference}, invocation)
    assert result is not None
    assert (result.finding, result.detail) == (
        probes.Finding.INCONCLUSIVE,
        "no business_reference recorded to ask by",
    )
    assert standin.refunds.lookups_started == 0
    # Once the runtime reported one (its outcome lost the rest), the probe asks by it.
    api.intent(invocation_id="inv-2", idempotency_key="refund-SO-2", attempt_id="a1")
    api.outcome("inv-2", "a1", kind="post_dispatch_evidence_failed", business_reference="RF-2")
    perform_refund(standin, "RF-2")  # the stand-in finds refunds by the key it is given
    named = Invocation.objects.get(invocation_id="inv-2")
    result = probes.run({**refunds.probe, "url": by_reference}, named)
    assert result is not None and result.finding is probes.Finding.PRESENT
    assert result.summary["url"].endswith("?idempotency_key=RF-2")


def test_probe_secrets_fill_headers_and_are_never_recorded(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    flagged(api)
    config = {**refunds.probe, "headers": {"Authorization": "Bearer {secret:PAYMENTS}"}}
    Capability.objects.filter(pk=refunds.pk).update(probe=config)
    with override_settings(LEDGER_PROBE_SECRETS={"PAYMENTS": "sk_live_hush"}):
        reconcile_invocation.run("inv-1")
    invocation = Invocation.objects.get()
    assert invocation.status == "retry_allowed"
    assert "sk_live_hush" not in str(list(invocation.events.values_list("data", flat=True)))


def test_a_probe_whose_secret_is_not_configured_concludes_nothing_and_says_why(
    api: Api, refunds: Capability, standin: StandInService, caplog: pytest.LogCaptureFixture
) -> None:
    """A deployment that lost a setting: the worker records the probe's run as
    inconclusive, naming the missing secret, and the invocation waits for its next
    probe or a person; nothing is asked of the business system without its secret."""
    flagged(api)
    perform_refund(standin, "refund-SO-1")
    config = {**refunds.probe, "headers": {"Authorization": "Bearer {secret:PAYMENTS}"}}
    Capability.objects.filter(pk=refunds.pk).update(probe=config)
    with override_settings(LEDGER_PROBE_SECRETS={}):
        assert reconcile_invocation.run("inv-1") == "recorded"
    invocation = Invocation.objects.get()
    assert invocation.status == "reconciliation_required"
    probe_run = invocation.events.get(kind="probe_run").data
    assert (probe_run["finding"], probe_run["detail"]) == (
        "inconclusive",
        "misconfigured: secret 'PAYMENTS' is not configured",
    )
    assert standin.refunds.lookups_started == 0
    assert "probe misconfigured invocation=inv-1 error=secret 'PAYMENTS'" in caplog.text


def test_a_probe_asks_for_json_in_an_encoding_it_reads(api: Api, refunds: Capability) -> None:
    """Its rules read JSON, and a business system may answer by the Accept header; its
    people know the ledger's questions by their User-Agent. A header configured for the
    probe takes the place of the probe's own."""
    asked: list[tuple[str | None, ...]] = []

    class RecordsHeaders(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            asked.append(
                tuple(
                    self.headers.get(name) for name in ("Accept", "Accept-Encoding", "User-Agent")
                )
            )
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordsHeaders)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    invocation = flagged(api)
    config = {**refunds.probe, "url": f"http://127.0.0.1:{server.server_address[1]}/refunds"}
    try:
        probes.run(config, invocation)
        probes.run({**config, "headers": {"accept": "application/vnd.pay+json"}}, invocation)
    finally:
        server.shutdown()
        server.server_close()
    assert asked == [
        ("application/json", "gzip, deflate", "invocation-ledger-probe (read-only)"),
        ("application/vnd.pay+json", "gzip, deflate", "invocation-ledger-probe (read-only)"),
    ]


def test_a_probe_sends_no_cookie_an_earlier_answer_set(api: Api, refunds: Capability) -> None:
    """Probes share a client per thread; what one answer sets must not reach the next."""
    cookies_sent: list[str | None] = []

    class SetsACookie(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            cookies_sent.append(self.headers.get("Cookie"))
            body = json.dumps(NO_REFUND).encode()
            self.send_response(404)
            self.send_header("Set-Cookie", "session=from-the-first-answer; Path=/")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), SetsACookie)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    invocation = flagged(api)
    config = {**refunds.probe, "url": f"http://127.0.0.1:{server.server_address[1]}/refunds"}
    try:
        findings = [probes.run(config, invocation) for _ in range(3)]
    finally:
        server.shutdown()
        server.server_close()
    assert [result and result.finding for result in findings] == [probes.Finding.ABSENT] * 3
    assert cookies_sent == [None, None, None]


@contextmanager
def answering(status: int, answer: Any) -> Iterator[str]:
    """A business system answering every GET with `answer` as JSON: its URL."""
    body = json.dumps(answer).encode()

    class Answers(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/refunds"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("answered", "equals", "finding"),
    [
        (False, False, probes.Finding.ABSENT),
        (0, False, probes.Finding.INCONCLUSIVE),
        (None, False, probes.Finding.INCONCLUSIVE),
        ([False], False, probes.Finding.INCONCLUSIVE),
        ([False, 1.0], [False, 1], probes.Finding.ABSENT),  # 1.0 and 1: one JSON number
        ([0], [False], probes.Finding.INCONCLUSIVE),
        ({"paid": 1}, {"paid": True}, probes.Finding.INCONCLUSIVE),
    ],
)
def test_a_rule_equals_only_the_same_json_value(
    api: Api, refunds: Capability, answered: Any, equals: Any, finding: probes.Finding
) -> None:
    """JSON's false is not its 0, though Python's False == 0: an absent rule waiting for
    `"refunded": false` must not take a count of nothing, or anything else, for it,
    however deep in the value it stands."""
    absent = {"status": 200, "json_path": "refunded", "equals": equals}
    with answering(200, {"refunded": answered}) as url:
        result = probes.run({**refunds.probe, "url": url, "absent": absent}, flagged(api))
    assert result is not None and result.finding is finding


@pytest.mark.parametrize(
    ("reference", "found"),
    [
        ("RF-7", "RF-7"),
        (7, "7"),
        ({"id": "RF-7"}, None),
        ([], None),
        (True, None),
        ("", None),
        ("R" * 257, None),
    ],
)
def test_a_probe_reference_must_be_a_usable_one(
    api: Api, refunds: Capability, reference: Any, found: str | None
) -> None:
    """An answer whose reference is an object, a list or a long text is no evidence of
    which refund it was: inconclusive, never a reference like "{'id': 'RF-7'}"."""
    with answering(200, {"status": "succeeded", "id": reference}) as url:
        result = probes.run({**refunds.probe, "url": url}, flagged(api))
    assert result is not None
    if found is None:
        assert result.finding is probes.Finding.INCONCLUSIVE
        assert "the reference at 'id'" in result.detail
    else:
        assert (result.finding, result.business_reference) == (probes.Finding.PRESENT, found)


def test_no_probe_escalates_at_once(api: Api, refund: Capability) -> None:
    flagged(api)
    reconcile_invocation.run("inv-1")
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.cause) == ("escalated", "no_probe")


def test_a_python_probe_must_be_allow_listed(api: Api, refunds: Capability, settings: Any) -> None:
    invocation = flagged(api)
    config = {"kind": "python", "callable": "tests.reconciliation.test_reconcile.always_present"}
    with pytest.raises(probes.ProbeConfigError):
        probes.run(config, invocation)
    settings.LEDGER_PYTHON_PROBES = [config["callable"]]
    result = probes.run(config, invocation)
    assert result is not None and result.business_reference == "RF-python"


def always_present(invocation: Invocation) -> probes.ProbeResult:
    return probes.ProbeResult(probes.Finding.PRESENT, business_reference="RF-python")


def test_a_python_probe_that_answers_wrongly_is_inconclusive(
    api: Api, refunds: Capability, settings: Any
) -> None:
    """Not a crash: a task that raised would leave its lease to expire, be claimed
    again and raise again, forever, two events per round."""
    flagged(api)
    refunds.probe = {"kind": "python", "callable": f"{__name__}.answers_with_a_dict"}
    refunds.save()
    settings.LEDGER_PYTHON_PROBES = [refunds.probe["callable"]]
    assert reconcile_invocation.run("inv-1") == "recorded"
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.probe_tries) == ("reconciliation_required", 1)
    probe_run = invocation.events.get(kind="probe_run").data
    assert probe_run["finding"] == "inconclusive"
    assert probe_run["detail"] == "probe returned dict, not a ProbeResult"


def answers_with_a_dict(invocation: Invocation) -> dict[str, str]:
    return {"finding": "effect_present"}


def test_a_python_probe_reference_must_be_text(
    api: Api, refunds: Capability, settings: Any
) -> None:
    invocation = flagged(api)
    config = {"kind": "python", "callable": f"{__name__}.finds_an_object"}
    settings.LEDGER_PYTHON_PROBES = [config["callable"]]
    result = probes.run(config, invocation)
    assert result is not None and result.finding is probes.Finding.INCONCLUSIVE
    assert result.detail == "probe returned a reference that is not text of at most 256"


def finds_an_object(invocation: Invocation) -> probes.ProbeResult:
    return probes.ProbeResult(probes.Finding.PRESENT, business_reference={"id": 7})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("asked", "waited"),
    [(45, 45.0), (7200.5, probes.RETRY_AFTER_MAX_SECONDS), ("soon", 0.0), (float("nan"), 0.0)],
)
def test_a_python_probes_wait_is_bounded_and_a_wrong_one_ignored(
    api: Api, refunds: Capability, settings: Any, asked: Any, waited: float
) -> None:
    """A python probe may ask for a wait as an http answer's Retry-After does; one that
    is not a number must not stop its result being recorded."""
    flagged(api)
    config = {"kind": "python", "callable": f"{__name__}.asks_to_wait"}
    settings.LEDGER_PYTHON_PROBES = [config["callable"]]
    ASKED_WAIT[:] = [asked]
    result = probes.run(config, Invocation.objects.get())
    assert result is not None and result.finding is probes.Finding.INCONCLUSIVE
    assert result.retry_after == waited


ASKED_WAIT: list[Any] = []


def asks_to_wait(invocation: Invocation) -> probes.ProbeResult:
    return probes.ProbeResult(probes.Finding.INCONCLUSIVE, retry_after=ASKED_WAIT[0])


def test_only_one_claim_holds_and_an_expired_lease_reopens(api: Api, refunds: Capability) -> None:
    flagged(api)
    now = timezone.now()
    assert services.invocation_claim(invocation_id="inv-1", worker="a", now=now)
    assert services.invocation_claim(invocation_id="inv-1", worker="b", now=now) is None
    later = now + dt.timedelta(seconds=61)
    assert services.expire_lease(invocation_id="inv-1", now=later)
    assert services.invocation_claim(invocation_id="inv-1", worker="b", now=later)
    # Worker a comes back from the dead: its answer is not applied.
    found = probes.ProbeResult(probes.Finding.ABSENT)
    assert services.record_probe_result(invocation_id="inv-1", worker="a", result=found) is None
    assert services.record_probe_result(invocation_id="inv-1", worker="b", result=found)
    assert Invocation.objects.get().status == "retry_allowed"
    assert events()[-4:] == [
        "reconciliation_claimed",
        "lease_expired",
        "reconciliation_claimed",
        "probe_run",
    ]


def test_a_probe_that_may_take_longer_than_the_lease_is_claimed_for_as_long_as_it_may_take(
    api: Api, refunds: Capability
) -> None:
    """Else the lease would run out under a probe still waiting for its answer: a
    second probe beside it, and a hung worker counted where there was none."""
    flagged(api, "inv-1", key="refund-SO-1")
    flagged(api, "inv-2", key="refund-SO-2")
    now = timezone.now()
    quick = services.invocation_claim(invocation_id="inv-1", worker="a", now=now)
    Capability.objects.filter(pk=refunds.pk).update(
        probe={**refunds.probe, "connect_timeout": 3, "read_timeout": 60}
    )
    slow = services.invocation_claim(invocation_id="inv-2", worker="a", now=now)
    assert quick is not None and slow is not None
    assert quick.lease_expires_at == now + dt.timedelta(seconds=60)  # LEDGER_PROBE_LEASE_SECONDS
    # Its deadline (3 + 60 s: every read keeps it), and 5 s to record its answer.
    assert slow.lease_expires_at == now + dt.timedelta(seconds=68)
    assert sweeper.expire_leases(now=now + dt.timedelta(seconds=67)) == 1
    assert Invocation.objects.get(invocation_id="inv-1").status == "reconciliation_required"
    assert Invocation.objects.get(invocation_id="inv-2").status == "reconciling"


def test_a_python_probe_is_claimed_for_the_timeout_it_declares(
    api: Api, refunds: Capability, settings: Any
) -> None:
    """A python probe bounds its own waits; the claim must outlast them, or a second
    probe starts beside one that is still asking a slow business system."""
    flagged(api)
    config = {"kind": "python", "callable": f"{__name__}.always_present", "timeout": 300}
    settings.LEDGER_PYTHON_PROBES = [config["callable"]]
    assert problems(config) == []
    Capability.objects.filter(pk=refunds.pk).update(probe=config)
    now = timezone.now()
    claimed = services.invocation_claim(invocation_id="inv-1", worker="a", now=now)
    # Its answer is waited for 300 s, and then recorded (RECORD_SECONDS).
    assert claimed is not None and claimed.lease_expires_at == now + dt.timedelta(seconds=305)
    assert "timeout: 0 is less than or equal to the minimum of 0" in problems(
        {**config, "timeout": 0}
    )


def test_a_python_probe_that_does_not_answer_frees_the_worker_at_its_timeout(
    api: Api,
    refunds: Capability,
    settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A business system's client library without a timeout hangs the callable: its
    answer is waited for the timeout the probe declares, then it is inconclusive and
    the worker's thread goes on to the next job, while the callable runs on in a
    thread of its own. Only so many run on at once (two here): past them a python probe
    is not started, so that one that never returns cannot take a thread per
    invocation, and the worker's log says so."""
    config = {"kind": "python", "callable": f"{__name__}.hangs", "timeout": 0.2}
    settings.LEDGER_PYTHON_PROBES = [config["callable"]]
    monkeypatch.setattr(probes, "PYTHON_PROBES_AT_ONCE", 2)
    monkeypatch.setattr(probes, "_python_slots", threading.BoundedSemaphore(2))
    Capability.objects.filter(pk=refunds.pk).update(probe=config)
    for n in (1, 2, 3):
        flagged(api, f"inv-{n}", key=f"k-{n}")
    HANGING.clear()
    try:
        assert [reconcile_invocation.run(f"inv-{n}") for n in (1, 2, 3)] == ["recorded"] * 3
    finally:
        HANGING.set()
    details = [
        Invocation.objects.get(invocation_id=f"inv-{n}").events.get(kind="probe_run").data
        for n in (1, 2, 3)
    ]
    assert [(d["finding"], d["detail"]) for d in details] == [
        ("inconclusive", "no answer within 0.2 s; the probe runs on, unwatched"),
        ("inconclusive", "no answer within 0.2 s; the probe runs on, unwatched"),
        ("inconclusive", "not started: 2 python probes still run in this process"),
    ]
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "python probe not started: 2 python probes still run in this process "
        "invocation=inv-3; restarting the worker frees their threads"
    ]
    assert all(d["duration_ms"] < 5000 for d in details)
    wait_for(lambda: not any(thread.name == "python-probe" for thread in threading.enumerate()))


def test_a_python_probe_is_waited_for_no_longer_than_it_declares(
    api: Api, refunds: Capability, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The console waits up to 30 s for a try; a probe declaring 0.1 s is waited for
    0.1 s, as a worker waits for it. Its answer, when it comes, is logged and dropped:
    whoever set the timeout sees it is too short."""
    config = {"kind": "python", "callable": f"{__name__}.hangs", "timeout": 0.1}
    settings.LEDGER_PYTHON_PROBES = [config["callable"]]
    HANGING.clear()
    try:
        result = probes.run(config, flagged(api), python_wait=30)
    finally:
        HANGING.set()
    assert result is not None and result.duration_ms < 5000
    assert result.detail == "no answer within 0.1 s; the probe runs on, unwatched"
    late = "python probe answered after its wait invocation=inv-1 waited=0.1s took="
    wait_for(lambda: late in caplog.text)
    assert "finding=effect_present" in caplog.text.split(late)[1].splitlines()[0]


HANGING = threading.Event()


def hangs(invocation: Invocation) -> probes.ProbeResult:
    """Answers once HANGING is set, as a business system's client that waits forever."""
    HANGING.wait(timeout=60)
    return probes.ProbeResult(probes.Finding.PRESENT, business_reference="RF-late")


def test_a_claim_whose_worker_is_gone_reopens_before_its_lease_runs_out(
    api: Api, refunds: Capability
) -> None:
    """A worker holds its probe lock in its own database session, which PostgreSQL ends
    however the worker died: the sweep reopens that claim then, not a lease later, and
    leaves a live worker's claim alone."""
    flagged(api)
    worker = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    locked = worker.execute(
        "SELECT pg_try_advisory_lock(hashtext(%s), hashtext('inv-1'))", [services.PROBE_LOCKS]
    ).fetchone()
    assert locked == (True,)
    claimed = services.invocation_claim(invocation_id="inv-1", worker="host:42")
    assert claimed is not None and claimed.lease_expires_at is not None
    assert sweeper.release_lost_claims() == 0
    assert sweeper.expire_leases() == 0
    assert Invocation.objects.get().status == "reconciling"

    worker.close()  # the worker's session ends, and its lock with it
    wait_for(lambda: sweeper.release_lost_claims() == 1)
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.lease_owner, invocation.lease_expires_at) == (
        "reconciliation_required", "", None,
    )  # fmt: skip
    lost = invocation.events.get(kind="probe_worker_lost")
    assert lost.actor == "ledger:sweeper"
    assert (lost.data["worker"], lost.data["lease_expires_at"]) == (
        "host:42", claimed.lease_expires_at.isoformat(),
    )  # fmt: skip
    assert lost.data["state"]["status"] == "reconciliation_required"
    assert lost.created_at < claimed.lease_expires_at
    assert sweeper.release_lost_claims() == 0
    assert services.invocation_claim(invocation_id="inv-1", worker="host:43")


def test_a_probe_job_holds_the_lock_while_it_probes_and_lets_go_however_it_ends(
    api: Api, refunds: Capability, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    flagged(api)
    refunds.probe = {"kind": "python", "callable": f"{__name__}.sees_its_lock_held"}
    refunds.save()
    settings.LEDGER_PYTHON_PROBES = [refunds.probe["callable"]]
    assert reconcile_invocation.run("inv-1") == "recorded"
    assert Invocation.objects.get().events.get(kind="probe_run").data["detail"] == "lock held"
    assert services.without_probe_lock(["inv-1"]) == {"inv-1"}

    flagged(api, "inv-2", key="refund-SO-2")
    monkeypatch.setattr(probes, "run", crashes)  # the job itself fails, not the probe
    with pytest.raises(MemoryError):
        reconcile_invocation.run("inv-2")
    assert services.without_probe_lock(["inv-2"]) == {"inv-2"}


# Sessions a test holds the probe lock in: not the job's.
NOT_THE_JOBS: list[int] = []


def sees_its_lock_held(invocation: Invocation) -> probes.ProbeResult:
    """Whether the job's session holds the invocation's probe lock as it is probed. A
    python probe runs in a thread, and so a database session, of its own: the job's is
    any other but those the test holds it in (NOT_THE_JOBS)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*) FROM pg_locks
            WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()
              AND NOT pid = ANY(%s)
              AND objsubid = 2 AND classid = hashtext(%s)::oid AND objid = hashtext(%s)::oid
            """,
            [NOT_THE_JOBS, services.PROBE_LOCKS, invocation.invocation_id],
        )
        (held,) = cursor.fetchone()
    return probes.ProbeResult(
        probes.Finding.INCONCLUSIVE, detail=f"lock {'held' if held else 'not held'}"
    )


def crashes(config: dict[str, Any], invocation: Invocation) -> probes.ProbeResult:
    raise MemoryError


def test_a_probe_job_waits_briefly_for_a_lock_another_job_holds_then_takes_it(
    api: Api, refunds: Capability, settings: Any
) -> None:
    """Another job for the same invocation may hold the lock for the moment of its claim:
    this one waits for it rather than claim without it (a claim the sweep would then
    take for a lost worker's)."""
    flagged(api)
    refunds.probe = {"kind": "python", "callable": f"{__name__}.sees_its_lock_held"}
    refunds.save()
    settings.LEDGER_PYTHON_PROBES = [refunds.probe["callable"]]
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as other:
        take = "SELECT pg_advisory_lock(hashtext(%s), hashtext('inv-1'))"
        other.execute(take, [services.PROBE_LOCKS])

        def let_go_once_the_job_waits() -> None:
            with psycopg.connect(**params, autocommit=True) as onlooker:
                waiting = (
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                )
                wait_for(lambda: onlooker.execute(waiting).fetchone() == (1,))
            other.execute(
                take.replace("pg_advisory_lock", "pg_advisory_unlock"), [services.PROBE_LOCKS]
            )

        letting_go = threading.Thread(target=let_go_once_the_job_waits)
        letting_go.start()
        assert reconcile_invocation.run("inv-1") == "recorded"
        letting_go.join()
    assert Invocation.objects.get().events.get(kind="probe_run").data["detail"] == "lock held"


def test_a_probe_job_whose_lock_another_session_keeps_still_claims_and_probes(
    api: Api, refunds: Capability, settings: Any
) -> None:
    """The lock only shortens a lost worker's wait; it never stops a probe. One kept by
    a session that no longer probes (behind a transaction-mode pooler, say) leaves the
    job to claim without it once it has waited PROBE_LOCK_WAIT."""
    flagged(api)
    refunds.probe = {"kind": "python", "callable": f"{__name__}.sees_its_lock_held"}
    refunds.save()
    settings.LEDGER_PYTHON_PROBES = [refunds.probe["callable"]]
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        other.execute(
            "SELECT pg_advisory_lock(hashtext(%s), hashtext('inv-1'))", [services.PROBE_LOCKS]
        )
        NOT_THE_JOBS[:] = [other.info.backend_pid]
        try:
            assert reconcile_invocation.run("inv-1") == "recorded"
        finally:
            NOT_THE_JOBS.clear()
        assert services.without_probe_lock(["inv-1"]) == set()  # still the other's
    probe_run = Invocation.objects.get().events.get(kind="probe_run")
    assert probe_run.data["detail"] == "lock not held"
    assert services.without_probe_lock(["inv-1"]) == {"inv-1"}


def test_two_threads_of_one_worker_hold_claims_under_different_names(
    api: Api, refunds: Capability
) -> None:
    """A thread whose lease ran out and was taken over by another thread of its process
    cannot record its answer as the claim's holder."""
    names: list[str] = []
    thread = threading.Thread(target=lambda: names.append(worker_name()))
    thread.start()
    thread.join()
    names.append(worker_name())
    assert len(set(names)) == 2
    flagged(api)
    now = timezone.now()
    assert services.invocation_claim(invocation_id="inv-1", worker=names[0], now=now)
    later = now + dt.timedelta(seconds=61)
    assert services.expire_lease(invocation_id="inv-1", now=later)
    assert services.invocation_claim(invocation_id="inv-1", worker=names[1], now=later)
    found = probes.ProbeResult(probes.Finding.ABSENT)
    assert (
        services.record_probe_result(invocation_id="inv-1", worker=names[0], result=found) is None
    )
    assert Invocation.objects.get().status == "reconciling"


def ada_finds_rf_77() -> Invocation:
    return services.invocation_resolve(
        invocation_id="inv-1",
        actor="user:ada",
        effect=policy.Effect.PRESENT,
        business_reference="RF-77",
        note="found in the payments console",
    )


def test_a_person_resolves_with_a_note_and_a_reference(api: Api, refunds: Capability) -> None:
    flagged(api)
    with pytest.raises(LedgerError):
        services.invocation_resolve(
            invocation_id="inv-1", actor="user:ada", effect=policy.Effect.PRESENT, note="seen"
        )
    with pytest.raises(LedgerError):
        services.invocation_resolve(
            invocation_id="inv-1", actor="user:ada", effect=policy.Effect.ABSENT, note=" "
        )
    ada_finds_rf_77()
    invocation = Invocation.objects.get()
    assert invocation.status == "succeeded"
    resolution = invocation.events.get(kind="resolution")
    assert (resolution.actor, resolution.data["note"]) == (
        "user:ada",
        "found in the payments console",
    )
    with pytest.raises(LedgerError) as refused:  # terminal: nothing left to resolve
        services.invocation_resolve(
            invocation_id="inv-1", actor="user:bob", effect=policy.Effect.ABSENT, note="no"
        )
    assert refused.value.type == "not_reconcilable"


@pytest.mark.parametrize(
    ("reference", "status"),
    [("RF-77", "succeeded"), ("", "succeeded"), ("RF-78", "escalated")],
    ids=["the same", "none", "another"],
)
def test_a_late_success_is_checked_against_the_reference_a_person_resolved_with(
    api: Api, refunds: Capability, reference: str, status: str
) -> None:
    """The person found RF-77; the runtime's lost outcome arrives naming RF-78: one
    intent may have had two effects, and a person must look again."""
    flagged(api)
    ada_finds_rf_77()

    code, body = api.outcome("inv-1", "a1", kind="succeeded", business_reference=reference)

    assert (code, body["status"]) == (201, status)
    if status == "escalated":
        assert (body["cause"], body["flags"]) == ("evidence_conflict", ["evidence_conflict"])
    else:  # the person named it for this very invocation: not shared
        assert body["flags"] == []


def test_a_high_risk_resolution_needs_a_second_person(api: Api, refunds: Capability) -> None:
    Capability.objects.filter(pk=refunds.pk).update(risk_level="high")
    flagged(api)
    services.invocation_resolve(
        invocation_id="inv-1", actor="user:ada", effect=policy.Effect.ABSENT, note="not there"
    )
    assert Invocation.objects.get().status == "resolution_proposed"
    assert api.attempt("inv-1", "a2")[1]["error"]["type"] == "attempt_refused"
    with pytest.raises(LedgerError) as same:
        services.invocation_approve(invocation_id="inv-1", actor="user:ada")
    assert same.value.type == "same_person"
    services.invocation_approve(invocation_id="inv-1", actor="user:bob", note="agreed")
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.proposal) == ("retry_allowed", None)
    approved = invocation.events.get(kind="resolution_approved").data
    assert (approved["proposed_by"], approved["approved_by"]) == ("user:ada", "user:bob")


def test_a_rejected_proposal_goes_back_to_a_person(api: Api, refunds: Capability) -> None:
    Capability.objects.filter(pk=refunds.pk).update(risk_level="high")
    flagged(api)
    services.invocation_resolve(
        invocation_id="inv-1", actor="user:ada", effect=policy.Effect.ABSENT, note="?"
    )
    services.invocation_reject(invocation_id="inv-1", actor="user:bob", note="check again")
    invocation = Invocation.objects.get()
    assert (invocation.status, invocation.cause) == ("escalated", "proposal_rejected")


def test_late_evidence_that_contradicts_a_resolution_escalates(
    api: Api, refunds: Capability, standin: StandInService
) -> None:
    flagged(api)
    reconcile_invocation.run("inv-1")  # nothing found: retry allowed
    api.attempt("inv-1", "a2")
    api.outcome("inv-1", "a2", kind="succeeded", business_reference="RF-2")
    # The first attempt's outcome finally arrives: it had succeeded too.
    status, body = api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    assert (status, body["status"], body["cause"]) == (201, "escalated", "evidence_conflict")
    assert body["flags"] == ["evidence_conflict"]


named_references = importlib.import_module("ledger.migrations.0025_named_reference")


def test_every_reference_named_is_kept_with_its_first_namer_and_the_migration_agrees(
    api: Api, refunds: Capability
) -> None:
    """Each path that names a reference keeps it once, under the invocation that named
    it first; 0025 recovers the same from the events of a ledger that predates it."""
    for n in (1, 2, 3):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
    api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    api.outcome("inv-2", "a1", kind="succeeded", business_reference="RF-1")  # shared
    api.outcome("inv-3", "a1", kind="succeeded", business_reference="RF-3")
    conflict = api.outcome("inv-3", "a1", kind="succeeded", business_reference="RF-4")
    assert conflict[1]["error"]["type"] == "outcome_conflict"
    flagged(api, "inv-4", "k-4")
    services.invocation_resolve(
        invocation_id="inv-4",
        actor="user:ada",
        effect=policy.Effect.PRESENT,
        business_reference="RF-5",
        note="in the console",
    )
    kept = dict(NamedReference.objects.values_list("reference", "first_named_by__invocation_id"))
    assert kept == {"RF-1": "inv-1", "RF-3": "inv-3", "RF-4": "inv-3", "RF-5": "inv-4"}

    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no checks pending, as TRUNCATE asks
        cursor.execute("TRUNCATE ledger_namedreference")  # DELETE is refused (append-only)
        cursor.execute(named_references.BACKFILL)
    recovered = dict(
        NamedReference.objects.values_list("reference", "first_named_by__invocation_id")
    )
    assert recovered == kept
