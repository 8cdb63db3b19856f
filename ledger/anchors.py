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
"""

from __future__ import annotations

import datetime as dt
import logging
import ssl
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings

from ledger.models import AdminAction, Anchor, Seal

log = logging.getLogger(__name__)

# The most of the store's answer kept as its receipt.
RECEIPT_CHARS = 1000
TIMEOUT = httpx.Timeout(10.0, connect=5.0)


class AnchorRefused(Exception):
    """The store did not take the hashes: unreachable, or it answered other than 2xx."""


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
    try:
        answer = httpx.post(
            url, json=payload(seal, action), headers=headers, timeout=TIMEOUT, verify=_trust()
        )
    except httpx.HTTPError as exc:
        raise AnchorRefused(f"{type(exc).__name__}: {exc}"[:300]) from None
    if not answer.is_success:
        raise AnchorRefused(f"answered {answer.status_code}: {answer.text[:200]!r}")
    return Anchor.objects.create(
        seal=seal,
        seal_hash=seal_hash,
        action=action,
        action_hash=action_hash,
        url=where(url),
        status=answer.status_code,
        receipt=answer.text[:RECEIPT_CHARS],
    )


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


def sent(count: int) -> list[Anchor]:
    """The last `count` anchors, newest first, with their seals."""
    return list(Anchor.objects.select_related("seal").order_by("-id")[:count])


def not_held(hashes: list[str]) -> list[str]:
    """The hashes, kept outside the database, that no seal or action in it has. The
    chains' own checks (ledger.integrity.verify) say whether what it holds leads to
    them."""
    held = set(Seal.objects.filter(hash__in=hashes).values_list("hash", flat=True))
    held |= set(AdminAction.objects.filter(hash__in=hashes).values_list("hash", flat=True))
    return [hash_ for hash_ in hashes if hash_ not in held]
