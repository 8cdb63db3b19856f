"""Anchors: the newest seal's hash and the action log's, sent outside the database.

A seal chains every event before it, and the action log's newest hash every action.
Whoever can rewrite the database can rewrite the events and recompute every hash, seals
included; what they cannot rewrite is a copy kept by someone else. The sealer logs
each seal's hash for that; with LEDGER_ANCHOR_URL set, beat also POSTs the newest
hashes there every LEDGER_ANCHOR_INTERVAL_SECONDS (a company's log store, a
transparency log, a timestamping service's front), and keeps each answer as an
`Anchor`. `verify_ledger --anchored HASH`, given a hash from that store, then says
whether the database still holds it.

Only the newest hashes are sent: each chains the ones before, so an anchor skipped
while the store was down is covered by the next.

With LEDGER_ANCHOR_PROTOCOL=rfc3161 the URL is a time-stamping authority's (RFC 3161):
it is sent the SHA-256 of the hashes' message (`message`) and answers with a token it
signed, naming the time. The ledger keeps the token and checks it, as it arrives and
in `verify_ledger`, against the authority's root certificates
(LEDGER_ANCHOR_TSA_ROOTS): a copy the ledger holds and no one can forge, where a
store's copy is held, and checked, elsewhere.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from cryptography import x509
from django.conf import settings
from rfc3161_client import (
    HashAlgorithm,
    PKIStatus,
    TimeStampRequest,
    TimestampRequestBuilder,
    VerificationError,
    Verifier,
    VerifierBuilder,
    decode_timestamp_response,
)

from ledger import outbound
from ledger.chain import canonical
from ledger.models import AdminAction, Anchor, Seal

log = logging.getLogger(__name__)

# The most of the store's answer kept as its receipt.
RECEIPT_CHARS = 1000
# How long the store is given to take a connection, and each read of its answer;
# together, the whole answer.
CONNECT_SECONDS, READ_SECONDS = 5.0, 10.0
# The most of a store's answer read: a receipt, or a timestamp token of a few KiB.
ANSWER_MAX_BYTES = 64 * 1024


class AnchorRefused(Exception):
    """The store did not take the hashes: unreachable, or it answered other than 2xx
    (or, from a time-stamping authority, other than a token that verifies)."""


class TokenBroken(Exception):
    """A timestamp token that does not verify: not signed under the authority's roots,
    or over another message than the anchor's seal and action give now."""


def payload(seal: Seal | None, action: AdminAction | None) -> dict[str, Any]:
    """What the store is sent: each hash with what places it in its chain."""
    return {
        "seal": seal
        and {
            "hash": seal.hash,
            "prev_hash": seal.prev_hash,
            "first_sequence": seal.first_sequence,
            "last_sequence": seal.last_sequence,
            "event_count": seal.event_count,
            "merkle_root": seal.merkle_root,
            "created_at": seal.created_at.isoformat(),
        },
        "action_log": action
        and {"id": action.pk, "hash": action.hash, "created_at": action.created_at.isoformat()},
    }


def message(seal: Seal | None, action: AdminAction | None) -> bytes:
    """What a time-stamping authority is sent the digest of: the payload as canonical
    JSON (RFC 8785), which the seal's and the action's rows give again."""
    return canonical(payload(seal, action))


def anchor_newest() -> Anchor | None:
    """Send the newest seal's hash and the action log's to LEDGER_ANCHOR_URL, unless the
    last anchor sent these; the anchor recorded, or None when there was nothing new.
    AnchorRefused when the store did not take them (the next run sends them again)."""
    url = settings.LEDGER_ANCHOR_URL
    seal = Seal.objects.order_by("-last_sequence").first()
    action = AdminAction.objects.order_by("-id").first()
    seal_hash, action_hash = seal.hash if seal else "", action.hash if action else ""
    last = newest()
    sent = last is not None and (last.seal_hash, last.action_hash) == (seal_hash, action_hash)
    if sent or not (seal_hash or action_hash):
        return None
    headers = {"User-Agent": "invocation-ledger-anchor"}
    if settings.LEDGER_ANCHOR_TOKEN:
        headers["Authorization"] = f"Bearer {settings.LEDGER_ANCHOR_TOKEN}"
    token = None
    if settings.LEDGER_ANCHOR_PROTOCOL == "rfc3161":
        signed = message(seal, action)
        request = (
            TimestampRequestBuilder()
            .data(signed)
            .hash_algorithm(HashAlgorithm.SHA256)
            .nonce(nonce=True)
            .cert_request(cert_request=True)
            .build()
        )
        headers["Content-Type"] = "application/timestamp-query"
        answer = _sent(url, headers, content=request.as_bytes())
        token = answer.content
        receipt = _granted(request, token, signed)
    else:
        answer = _sent(url, headers, json=payload(seal, action))
        receipt = answer.text[:RECEIPT_CHARS]
    return Anchor.objects.create(
        seal=seal,
        seal_hash=seal_hash,
        action=action,
        action_hash=action_hash,
        url=where(url),
        status=answer.status_code,
        receipt=receipt,
        token=token,
    )


def _sent(url: str, headers: dict[str, str], **body: Any) -> httpx.Response:
    """The store's answer, read whole within its connect and read timeouts and
    ANSWER_MAX_BYTES (`ledger.outbound`): anchoring runs in a probe worker's thread,
    which a store trickling its answer, or sending one without end, would hold."""
    headers = {**headers, "Accept-Encoding": outbound.ACCEPT_ENCODING}
    timeout = httpx.Timeout(READ_SECONDS, connect=CONNECT_SECONDS)
    client = outbound.reading_by_deadline(httpx.Client(timeout=timeout, verify=_trust()))
    try:
        with (
            client,
            outbound.deadline(CONNECT_SECONDS + READ_SECONDS),
            client.stream("POST", url, headers=headers, **body) as streamed,
        ):
            content = outbound.read_answer(streamed, ANSWER_MAX_BYTES)
    except httpx.HTTPError as exc:
        raise AnchorRefused(f"{type(exc).__name__}: {exc}"[:300]) from None
    except outbound.UnreadAnswer as exc:
        raise AnchorRefused(f"answered {streamed.status_code}: {exc}") from None
    answer = httpx.Response(streamed.status_code, content=content)
    if not answer.is_success:
        raise AnchorRefused(f"answered {answer.status_code}: {answer.text[:200]!r}")
    return answer


def _granted(request: TimeStampRequest, token: bytes, signed: bytes) -> str:
    """The receipt of a token that verifies as the answer to `request` over `signed`:
    when the authority signed it, and its serial number."""
    try:
        response = decode_timestamp_response(token)
    except ValueError as exc:
        raise AnchorRefused(f"answer is no timestamp response: {exc}"[:300]) from None
    if response.status not in (PKIStatus.GRANTED, PKIStatus.GRANTED_WITH_MODS):
        said = "; ".join(response.status_string) or "no reason given"
        status = PKIStatus(response.status).name.lower()
        raise AnchorRefused(f"the authority refused ({status}): {said}"[:300])
    try:
        _verifier(VerifierBuilder.from_request(request)).verify_message(response, signed)
    except (ValueError, VerificationError, TokenBroken) as exc:
        raise AnchorRefused(f"timestamp token does not verify: {exc}"[:300]) from None
    info = response.tst_info
    return f"genTime {info.gen_time.isoformat()} serial {info.serial_number}"


def check_token(anchor: Anchor, verifier: Verifier | None = None) -> dt.datetime:
    """When the authority signed the anchor's message, as its token says. TokenBroken
    when the token does not verify against LEDGER_ANCHOR_TSA_ROOTS, or the message it
    signed is no longer what the anchor's seal and action rows give (a row rewritten)."""
    verifier = verifier or _verifier(VerifierBuilder())
    try:
        response = decode_timestamp_response(bytes(anchor.token or b""))
        verifier.verify_message(response, message(anchor.seal, anchor.action))
    except (ValueError, VerificationError) as exc:
        raise TokenBroken(str(exc)) from None
    return response.tst_info.gen_time


@dataclass
class TokensChecked:
    checked: int = 0
    # (anchor id, why its token does not verify)
    broken: list[tuple[int, str]] = field(default_factory=list)
    # Tokens kept while LEDGER_ANCHOR_TSA_ROOTS is not set, which nothing can check.
    unchecked: int = 0
    newest: tuple[Anchor, dt.datetime] | None = None


def check_tokens() -> TokensChecked:
    """Every anchor's timestamp token checked, oldest first."""
    kept = Anchor.objects.filter(token__isnull=False).select_related("seal", "action")
    report = TokensChecked()
    if not settings.LEDGER_ANCHOR_TSA_ROOTS:
        report.unchecked = kept.count()
        return report
    verifier = _verifier(VerifierBuilder())
    for anchor in kept.order_by("id").iterator(chunk_size=500):
        report.checked += 1
        try:
            report.newest = anchor, check_token(anchor, verifier)
        except TokenBroken as exc:
            report.broken.append((anchor.pk, str(exc)))
    return report


def _verifier(builder: VerifierBuilder) -> Verifier:
    """A verifier of tokens under the root certificates in LEDGER_ANCHOR_TSA_ROOTS; the
    other certificates there are taken as intermediates."""
    path = settings.LEDGER_ANCHOR_TSA_ROOTS
    try:
        found = os.stat(path)
        certificates = _certificates(path, (found.st_ino, found.st_size, found.st_mtime_ns))
    except (OSError, ValueError) as exc:
        raise TokenBroken(f"LEDGER_ANCHOR_TSA_ROOTS {path!r}: {exc}") from None
    roots = [cert for cert in certificates if cert.subject == cert.issuer]
    if not roots:
        raise TokenBroken(f"LEDGER_ANCHOR_TSA_ROOTS {path!r} holds no root certificate")
    for certificate in certificates:
        if certificate in roots:
            builder = builder.add_root_certificate(certificate)
        else:
            builder = builder.add_intermediate_certificate(certificate)
    return builder.build()


@functools.lru_cache(maxsize=4)
def _certificates(path: str, stamp: tuple[int, int, int]) -> tuple[x509.Certificate, ...]:
    """The certificates in a PEM file, read once while its inode, size and modification
    time stay (the Verify page checks up to 20 tokens; renewed in place, it is read
    again)."""
    with open(path, "rb") as pem:
        return tuple(x509.load_pem_x509_certificates(pem.read()))


def _trust() -> ssl.SSLContext | bool:
    """What an https store is trusted by: what httpx trusts, and the CA certificates in
    LEDGER_ANCHOR_CA_FILE (a company's own CA, which signs its internal services')."""
    if not settings.LEDGER_ANCHOR_CA_FILE:
        return True
    context = httpx.create_ssl_context()
    try:
        context.load_verify_locations(settings.LEDGER_ANCHOR_CA_FILE)
    except (OSError, ssl.SSLError) as exc:
        raise AnchorRefused(
            f"LEDGER_ANCHOR_CA_FILE {settings.LEDGER_ANCHOR_CA_FILE!r}: {exc}"
        ) from None
    return context


def where(url: str) -> str:
    """The store's address as kept and logged: without any credentials or query the
    URL may carry."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


# The intervals a seal or an action may wait to be anchored before the dashboard and
# /metrics say the anchoring is behind.
MISSED_ANCHORS = 10


def behind(now: dt.datetime) -> bool:
    """Whether a seal or an action recorded ten anchor intervals ago is not anchored yet
    (the store refusing, or beat not running)."""
    a_while_ago = now - dt.timedelta(
        seconds=MISSED_ANCHORS * settings.LEDGER_ANCHOR_INTERVAL_SECONDS
    )
    anchored = (
        Anchor.objects.order_by("-id").values_list("seal__last_sequence", "action_id").first()
    ) or (None, None)
    seal = Seal.objects.filter(created_at__lte=a_while_ago).order_by("-last_sequence").first()
    action = AdminAction.objects.filter(created_at__lte=a_while_ago).order_by("-id").first()
    return (seal is not None and (anchored[0] or 0) < seal.last_sequence) or (
        action is not None and (anchored[1] or 0) < action.pk
    )


def newest() -> Anchor | None:
    return Anchor.objects.order_by("-id").first()


def sent(count: int) -> list[tuple[Anchor, str, bool]]:
    """The last `count` anchors, newest first, with their seals, each with what its
    timestamp token says when checked ("" without one) and whether it is broken."""
    shown = list(Anchor.objects.select_related("seal", "action").order_by("-id")[:count])
    return [(anchor, *_token_says(anchor)) for anchor in shown]


def _token_says(anchor: Anchor) -> tuple[str, bool]:
    if anchor.token is None:
        return "", False
    if not settings.LEDGER_ANCHOR_TSA_ROOTS:
        return "not checked: LEDGER_ANCHOR_TSA_ROOTS is not set", False
    try:
        return f"verifies: signed {check_token(anchor).isoformat()}", False
    except TokenBroken as exc:
        return f"does not verify: {exc}", True


def not_held(hashes: list[str]) -> list[str]:
    """The hashes, kept outside the database, that no seal or action in it has. The
    chains' own checks (ledger.integrity.verify) say whether what it holds leads to
    them."""
    held = set(Seal.objects.filter(hash__in=hashes).values_list("hash", flat=True))
    held |= set(AdminAction.objects.filter(hash__in=hashes).values_list("hash", flat=True))
    return [hash_ for hash_ in hashes if hash_ not in held]
