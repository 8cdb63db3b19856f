"""The newest seal's hash and the action log's, sent to a store outside the database."""

from __future__ import annotations

import datetime as dt
import io
import re
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trustme
from celery import current_app
from django.conf import settings as django_settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.db.utils import InternalError, ProgrammingError
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from ledger import anchors, outbound
from ledger.integrity import seal_events
from ledger.metrics import background_work
from ledger.models import AdminAction, Anchor, Seal
from ledger.tasks import anchor_hashes
from tests.conftest import (
    OPENSSL,
    AnchorStore,
    Api,
    TimestampAuthority,
    person,
    serving_anchor_store,
    serving_authority,
)
from tests.ledger.conftest import superuser_sql
from tests.ledger.test_metrics import scrape


def sealed(api: Api, invocation_id: str, now: dt.datetime | None = None) -> Seal:
    api.intent(invocation_id=invocation_id, idempotency_key=f"k-{invocation_id}")
    seal = seal_events(now=now)
    assert seal is not None
    return seal


def test_the_newest_hashes_are_sent_once_and_the_stores_receipt_kept(
    api: Api, anchor_store: AnchorStore, settings: Any
) -> None:
    settings.LEDGER_ANCHOR_URL = f"{anchor_store.url}?key=in-the-url"
    settings.LEDGER_ANCHOR_TOKEN = "anchor-t0ken"
    action = AdminAction.record(actor="cli:ada", action="token_issued", target="runtime a")
    first = sealed(api, "inv-1")

    assert anchor_hashes.run() is True
    assert anchor_hashes.run() is False  # nothing new: nothing sent
    second = sealed(api, "inv-2")
    assert anchor_hashes.run() is True

    assert len(anchor_store.received) == 2
    headers, body = anchor_store.received[0]
    assert headers["Authorization"] == "Bearer anchor-t0ken"
    assert body == {
        "seal": {
            "hash": first.hash,
            "prev_hash": first.prev_hash,
            "first_sequence": first.first_sequence,
            "last_sequence": first.last_sequence,
            "event_count": first.event_count,
            "merkle_root": first.merkle_root,
            "created_at": first.created_at.isoformat(),
        },
        "action_log": {
            "id": action.pk,
            "hash": action.hash,
            "created_at": action.created_at.isoformat(),
        },
    }
    assert anchor_store.received[1][1]["seal"]["hash"] == second.hash
    recorded = list(Anchor.objects.order_by("id").values_list("seal_hash", "url", "receipt"))
    # Kept without the URL's query, which may carry a credential.
    assert recorded == [
        (first.hash, anchor_store.url, "record-1"),
        (second.hash, anchor_store.url, "record-2"),
    ]


def test_a_store_that_does_not_take_them_is_sent_the_newest_when_it_does(
    api: Api, anchor_store: AnchorStore, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused (an answer other than 2xx) or unreachable: nothing is recorded as
    anchored, the log says why, and the next run sends the newest hashes then, which
    chain the ones it missed."""
    sealed(api, "inv-1")
    anchor_store.status = 503
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    assert anchor_hashes.run() is False
    settings.LEDGER_ANCHOR_URL = "http://127.0.0.1:9/anchors"  # nothing listens there
    assert anchor_hashes.run() is False
    assert not Anchor.objects.exists()
    assert "anchor not taken url=http://127.0.0.1:9/anchors: ConnectError" in caplog.text
    assert f"anchor not taken url={anchor_store.url}: answered 503: 'record-1'" in caplog.text

    newest = sealed(api, "inv-2")
    anchor_store.status = 200
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    assert anchor_hashes.run() is True
    assert anchor_store.received[-1][1]["seal"]["hash"] == newest.hash
    assert list(Anchor.objects.values_list("seal_hash", flat=True)) == [newest.hash]


@pytest.mark.parametrize(
    ("answering", "why"),
    [
        ("trickled", f"ReadTimeout: {outbound.ANSWER_LATE}"),
        ("long", f"answered 201: answer over {anchors.ANSWER_MAX_BYTES} bytes"),
    ],
)
def test_a_store_whose_answer_does_not_end_in_time_or_in_size_is_hung_up_on(
    api: Api,
    anchor_store: AnchorStore,
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    answering: str,
    why: str,
) -> None:
    """Anchoring runs in a probe worker's thread. httpx's timeouts bound each read, so
    a store sending its answer a byte at a time held the thread as long as it liked
    (here 2 s against timeouts of 0.5 s), and a receipt without end filled its memory:
    both were taken. The ledger hangs up at its connect and read timeouts from the
    start, or at ANSWER_MAX_BYTES, and records nothing."""
    sealed(api, "inv-1")
    monkeypatch.setattr(anchors, "CONNECT_SECONDS", 0.5)
    monkeypatch.setattr(anchors, "READ_SECONDS", 0.5)
    anchor_store.answering = answering
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    assert anchor_hashes.run() is False
    assert not Anchor.objects.exists()
    assert f"anchor not taken url={anchor_store.url}: {why}" in caplog.text


def test_without_a_store_nothing_is_sent_or_watched(
    api: Api, client: Client, settings: Any
) -> None:
    settings.LEDGER_ANCHOR_URL = ""
    sealed(api, "inv-1", now=timezone.now() - dt.timedelta(days=1))
    assert anchor_hashes.run() is False
    assert background_work().anchor_behind is None
    assert ("ledger_background_behind", (("work", "anchor"),)) not in scrape(client)


def test_anchoring_is_behind_when_a_seal_waits_ten_intervals(
    api: Api, anchor_store: AnchorStore, client: Client, settings: Any
) -> None:
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    settings.LEDGER_ANCHOR_INTERVAL_SECONDS = 60
    now = timezone.now()
    seal = sealed(api, "inv-1", now=now - dt.timedelta(minutes=11))
    assert anchors.behind(seal.created_at + dt.timedelta(minutes=9, seconds=59)) is False
    assert background_work(now).anchor_behind is True
    assert scrape(client)[("ledger_background_behind", (("work", "anchor"),))] == 1.0
    assert anchor_hashes.run() is True
    assert scrape(client)[("ledger_background_behind", (("work", "anchor"),))] == 0.0


@pytest.mark.parametrize(
    "statement", ["UPDATE ledger_anchor SET receipt = ''", "DELETE FROM ledger_anchor"]
)
def test_postgres_refuses_to_rewrite_an_anchor(
    api: Api, anchor_store: AnchorStore, settings: Any, statement: str
) -> None:
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    sealed(api, "inv-1")
    assert anchor_hashes.run() is True
    with (
        pytest.raises((InternalError, ProgrammingError), match="append-only"),
        connection.cursor() as cursor,
    ):
        cursor.execute(statement)


def test_verify_ledger_says_whether_the_ledger_still_holds_the_hashes_kept_outside(
    api: Api, anchor_store: AnchorStore, settings: Any
) -> None:
    """A reviewer takes the hashes from the store's copy: the ledger holds them, or its
    chains were rewritten after they were kept (a rewritten seal has another hash)."""
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    action = AdminAction.record(actor="cli:ada", action="token_issued", target="runtime a")
    seal = sealed(api, "inv-1")
    assert anchor_hashes.run() is True

    out = io.StringIO()
    call_command("verify_ledger", "--anchored", seal.hash, "--anchored", action.hash, stdout=out)
    assert "anchored: the ledger holds each of the 2 hash(es)" in out.getvalue()
    assert (
        f"newest anchor: seal {seal.hash}, action {action.hash}, sent to {anchor_store.url} at "
    ) in out.getvalue()

    rewritten = "9" * 64
    out = io.StringIO()
    with pytest.raises(CommandError, match="1 broken link"):
        call_command("verify_ledger", "--anchored", rewritten, stdout=out)
    assert f"BROKEN anchored hash {rewritten} is no seal's or action's in the ledger" in (
        out.getvalue()
    )


def test_the_verify_page_shows_the_newest_anchor_and_lists_those_sent(
    api: Api, anchor_store: AnchorStore, settings: Any
) -> None:
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    seal = sealed(api, "inv-1")
    reviewer = person("cora", "compliance")
    assert 'id="newest-anchor"' not in reviewer.get("/audit/verify/", {"run": "1"}).content.decode()
    assert anchor_hashes.run() is True
    page = reviewer.get("/audit/verify/", {"run": "1"}).content.decode()
    assert f"Newest anchor: seal <code>{seal.hash}</code>" in page
    assert f"sent to {anchor_store.url} at " in page and "<code>record-1</code>" in page
    second = sealed(api, "inv-2")
    assert anchor_hashes.run() is True
    listed = reviewer.get("/audit/verify/").content.decode()  # listed without a check run
    rows = listed.split('id="anchors"')[1].split("<tbody>")[1].split("</tbody>")[0]
    assert rows.index(second.hash) < rows.index(seal.hash)  # newest first
    assert f"<td>{second.first_sequence}\u2013{second.last_sequence}</td>" in rows  # en dash
    assert "<code>record-2</code>" in rows


def test_a_scrape_reads_three_statements_more_to_watch_the_anchoring(
    api: Api, anchor_store: AnchorStore, client: Client, settings: Any
) -> None:
    sealed(api, "inv-1")
    settings.LEDGER_ANCHOR_URL = ""
    with CaptureQueriesContext(connection) as unwatched:
        scrape(client)
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    with CaptureQueriesContext(connection) as watched:
        scrape(client)
    assert len(watched) - len(unwatched) == 3


def test_a_store_on_the_companys_own_ca_is_trusted_when_named(
    api: Api, settings: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An internal log store's certificate is signed by the company's CA: refused,
    and logged as such, until LEDGER_ANCHOR_CA_FILE names that CA."""
    ca = trustme.CA()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(tls)
    ca.cert_pem.write_to_path(str(tmp_path / "company-ca.pem"))
    seal = sealed(api, "inv-1")
    with serving_anchor_store(tls) as store:
        settings.LEDGER_ANCHOR_URL = store.url
        assert anchor_hashes.run() is False
        settings.LEDGER_ANCHOR_CA_FILE = str(tmp_path / "company-ca.pem")
        assert anchor_hashes.run() is True
    assert store.url.startswith("https://")
    assert "ConnectError: [SSL: CERTIFICATE_VERIFY_FAILED]" in caplog.text
    assert [body["seal"]["hash"] for _, body in store.received] == [seal.hash]


def test_the_anchoring_waits_on_its_store_beside_the_probes_not_the_sweep() -> None:
    """A store that hangs holds its job up to 15 s: on the probes' queue, whose workers
    expect to wait, not on the one the sweep and the sealer share."""
    routed = current_app.amqp.router.route({}, "ledger.tasks.anchor_hashes")
    assert routed["queue"].name == django_settings.LEDGER_PROBE_QUEUE != "celery"


def test_a_time_stamping_authority_signs_the_newest_hashes_and_its_token_is_checked(
    api: Api, authority: TimestampAuthority, tmp_path: Path
) -> None:
    """The authority is sent the digest of the hashes' message and signs it with the
    time: the ledger keeps its token, which verifies (by OpenSSL too, as an auditor
    holding the root certificate would check it) and which verify_ledger checks."""
    action = AdminAction.record(actor="cli:ada", action="token_issued", target="runtime a")
    seal = sealed(api, "inv-1")
    before = timezone.now().replace(microsecond=0)
    assert anchor_hashes.run() is True
    assert anchor_hashes.run() is False  # nothing new: not sent again
    assert authority.queries == 1
    anchor = Anchor.objects.get()
    assert (anchor.seal_hash, anchor.action_hash, anchor.url) == (
        seal.hash,
        action.hash,
        authority.url,
    )
    assert re.fullmatch(r"genTime \S+ serial \d+", anchor.receipt)
    assert anchors.check_token(anchor) >= before

    (tmp_path / "message.json").write_bytes(anchors.message(seal, action))
    (tmp_path / "token.tsr").write_bytes(bytes(anchor.token or b""))
    audited = subprocess.run(
        [OPENSSL, "ts", "-verify", "-data", tmp_path / "message.json",
         "-in", tmp_path / "token.tsr", "-CAfile", authority.roots],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert "Verification: OK" in audited.stdout, audited.stderr

    out = io.StringIO()
    call_command("verify_ledger", stdout=out)
    assert (
        f"timestamped: the 1 anchor token(s) verify against LEDGER_ANCHOR_TSA_ROOTS; the "
        f"newest, of seal {seal.hash}, was signed at "
    ) in out.getvalue()
    assert "(receipt 'genTime " in out.getvalue()
    assert "its timestamp token is checked above" in out.getvalue()
    page = person("cora", "compliance").get("/audit/verify/").content.decode()
    assert f"<td>verifies: signed {anchors.check_token(anchor).isoformat()}</td>" in page


def test_the_verify_page_reads_the_roots_once_until_they_are_renewed(
    api: Api, authority: TimestampAuthority, tmp_path: Path
) -> None:
    """The page checks each token it lists (20 at most) against the same roots file:
    read once, and again once it is replaced (here by another authority's roots, under
    which no token verifies)."""
    for n in range(3):
        sealed(api, f"inv-{n}")
        assert anchor_hashes.run() is True
    compliance = person("cora", "compliance")
    anchors._certificates.cache_clear()
    page = compliance.get("/audit/verify/").content.decode()
    assert page.count("<td>verifies: signed ") == 3
    assert anchors._certificates.cache_info()[:2] == (2, 1)  # hits, misses

    with serving_authority(tmp_path / "other") as other:
        renewed = authority.roots.with_suffix(".new")
        renewed.write_bytes(other.roots.read_bytes())
        renewed.replace(authority.roots)
    page = compliance.get("/audit/verify/").content.decode()
    assert page.count('<td class="behind">does not verify: ') == 3
    assert anchors._certificates.cache_info()[:2] == (4, 2)


def test_a_token_that_does_not_verify_or_a_refusal_is_not_kept(
    api: Api,
    authority: TimestampAuthority,
    tmp_path: Path,
    settings: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Signed under a root the ledger was not given (another authority's, or a
    stand-in's), or refused: nothing is recorded as anchored, the log says why, and the
    next run asks again."""
    sealed(api, "inv-1")
    with serving_authority(tmp_path / "other") as other:
        settings.LEDGER_ANCHOR_TSA_ROOTS = str(other.roots)
        assert anchor_hashes.run() is False
    settings.LEDGER_ANCHOR_TSA_ROOTS = str(authority.roots)
    authority.digests = "sha512"  # the ledger asks for SHA-256
    assert anchor_hashes.run() is False
    assert not Anchor.objects.exists()
    assert "timestamp token does not verify" in caplog.text
    assert "the authority refused (rejection): Message digest algorithm is not supported." in (
        caplog.text
    )
    authority.digests = "sha256"
    assert anchor_hashes.run() is True
    assert authority.queries == 3


def test_a_seal_rewritten_after_it_was_timestamped_breaks_its_token(
    api: Api, authority: TimestampAuthority
) -> None:
    """Whoever rewrites the database can recompute every hash, not the authority's
    signature: the token no longer verifies over what the rows give."""
    seal = sealed(api, "inv-1")
    assert anchor_hashes.run() is True
    superuser_sql(
        "UPDATE ledger_seal SET created_at = created_at - interval '1 day' WHERE id = %s",
        seal.pk,
    )
    out = io.StringIO()
    with pytest.raises(CommandError, match="broken link"):
        call_command("verify_ledger", stdout=out)
    anchor = Anchor.objects.get()
    assert (
        f"BROKEN anchor {anchor.pk}'s timestamp token does not verify (Mismatch between messages)"
    ) in out.getvalue()
    page = person("cora", "compliance").get("/audit/verify/").content.decode()
    assert '<td class="behind">does not verify: Mismatch between messages</td>' in page
