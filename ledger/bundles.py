"""Evidence bundles: chains with their covering seals and a manifest of hashes, that
`python -m ledger.verify_bundle` checks offline with the standard library alone; for
the console, as a zip with that verifier and a README."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from django.db.models import Max, Min
from django.utils import timezone

from ledger import anchors, chain
from ledger.audit import filters_given, search
from ledger.integrity import chains_touched, reading_every_row, seal_body, time_window
from ledger.models import Anchor, Event, Invocation, Seal, SealedEvent
from ledger.services import event_body

# A time-stamping authority's token of the bundle's anchor, and the message it signed.
TSA_MESSAGE, TSA_TOKEN = "anchor-message.json", "anchor-token.tsr"


def export_bundle(
    folder: Path,
    *,
    invocation_id: str | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    searched: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Write an evidence bundle that `python -m ledger.verify_bundle` checks
    offline: events (whole chains), their covering seals, a manifest of hashes.

    Its chains: one invocation's, those with events in [since, until), or (`searched`,
    the audit search's filters) those of every invocation the search finds."""
    folder.mkdir(parents=True, exist_ok=True)
    in_scope = Event.objects.all()
    if invocation_id:
        # One invocation's events are in its own month's partition only.
        invocation = Invocation.objects.filter(invocation_id=invocation_id).first()
        in_scope = Event.objects.none() if invocation is None else Event.objects.of(invocation)
    if searched is not None:
        # The search's range is of its invocations: their events are in its months.
        found = search({**searched, "after": None}).order_by().values("pk")
        months = Event.objects.recorded_between(searched.get("since"), searched.get("until"))
        in_scope = months.filter(invocation__in=found)
    events = (
        chains_touched(in_scope.filter(time_window(since, until)))
        .select_related("invocation", "sealed__seal")
        .order_by("invocation_id", "seq")
    )
    seal_ids: set[int] = set()
    count = 0
    with open(folder / "events.jsonl", "w") as out, reading_every_row():
        for event in events.iterator(chunk_size=2000):
            body = chain.canonical(event_body(event, event.invocation.invocation_id)).decode()
            sealed = getattr(event, "sealed", None)
            if sealed is not None:
                seal_ids.add(sealed.seal_id)
            record = {
                "body": body,
                "hash": event.hash,
                "sequence": sealed.sequence if sealed else None,
                "seal": sealed.seal.hash if sealed else None,
            }
            out.write(json.dumps(record) + "\n")
            count += 1
    # The covering seals and every seal between them: without those the seal chain
    # would seem broken wherever other invocations' events were sealed in between.
    # Those carry no leaves (their Merkle root is in their hashed body all the same).
    covering = Seal.objects.filter(pk__in=seal_ids)
    span = covering.aggregate(first=Min("last_sequence"), last=Max("last_sequence"))
    seals = Seal.objects.none()
    anchor = None
    if seal_ids:  # through seal_last_sequence_unique
        # The first anchor sent at or after the last covering seal, and the seals up to
        # its seal: a hash the anchor store holds must be in the bundle's seal chain.
        anchor = (
            Anchor.objects.filter(seal__last_sequence__gte=span["last"])
            .select_related("seal", "action")
            .order_by("seal__last_sequence", "id")
            .first()
        )
        through = anchor.seal.last_sequence if anchor and anchor.seal else span["last"]
        seals = Seal.objects.filter(
            last_sequence__gte=span["first"], last_sequence__lte=through
        ).order_by("last_sequence")
    sealed = 0
    with open(folder / "seals.jsonl", "w") as out:
        for seal in seals.iterator(chunk_size=2000):
            sealed += 1
            leaves = None
            if seal.pk in seal_ids:
                entries = SealedEvent.objects.filter(seal=seal).with_events().order_by("sequence")
                leaves = list(
                    entries.values_list("partitioned_event__hash", flat=True)  # type: ignore[misc]
                )
            record = {
                "body": chain.canonical(seal_body(seal)).decode(),
                "hash": seal.hash,
                "leaves": leaves,
            }
            out.write(json.dumps(record) + "\n")
    named = ["events.jsonl", "seals.jsonl"]
    if anchor is not None:
        # Where the ledger says it sent that seal's hash: whoever checks the bundle asks
        # that store for it, and gives the verifier the store's copy, never this one.
        sent = {
            "seal": anchor.seal_hash,
            "url": anchor.url,
            "sent_at": anchor.sent_at.isoformat(),
            "receipt": anchor.receipt,
        }
        if anchor.token is not None:
            # A time-stamping authority's signature over the anchor's message, which
            # names the seal: checked offline with OpenSSL and the authority's root
            # certificates (verify_bundle --tsa-roots), it anchors the bundle by itself.
            (folder / TSA_MESSAGE).write_bytes(anchors.message(anchor.seal, anchor.action))
            (folder / TSA_TOKEN).write_bytes(bytes(anchor.token))
            sent |= {"message": TSA_MESSAGE, "token": TSA_TOKEN}
            named += [TSA_MESSAGE, TSA_TOKEN]
        (folder / "anchors.jsonl").write_text(json.dumps(sent) + "\n")
        named.append("anchors.jsonl")
    files = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in named}
    manifest = {
        "created_at": timezone.now().isoformat(),
        "scope": {
            "invocation_id": invocation_id,
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
            **({"search": filters_given(searched)} if searched is not None else {}),
        },
        "files": files,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return {"events": count, "seals": sealed}


# What checks a bundle, standard library only: handed over inside an archive, so that
# whoever receives it checks it with nothing installed.
VERIFIER_FILES = ("ledger/__init__.py", "ledger/policy.py", "ledger/verify_bundle.py")
ARCHIVE_README = """\
Evidence bundle of {holding}, exported {exported} (UTC) by the Invocation Ledger.
To check it, with Python 3.11 or later and nothing else, in this folder:

    python3 -m ledger.verify_bundle .

It checks every event's hash and chain link, replays the recorded states through the
retry policy, and checks the seals' hashes, chain and Merkle roots. A seal hash from
the ledger's log, or from the store the ledger sends its seals to (anchors.jsonl, when
present, says which seal it sent where: ask that store for it), ties the bundle to the
ledger, which a consistent forgery cannot be:

    python3 -m ledger.verify_bundle . --seal HASH

When a time-stamping authority signed that seal (anchor-token.tsr, over
anchor-message.json), its root certificates anchor the bundle with no one's copy, the
signature checked by OpenSSL:

    python3 -m ledger.verify_bundle . --tsa-roots ROOTS.pem

The verifier (ledger/verify_bundle.py and ledger/policy.py) is here for convenience.
Whoever doubts the ledger's operators checks with their own copy from its source.
"""


def archive_name(naming: str) -> str:
    """An archive's folder (and file) name, in characters any file system takes."""
    return "evidence-" + re.sub(r"[^A-Za-z0-9._-]", "_", naming)


def bundle_archive(top: str, holding: str, **scope: Any) -> IO[bytes]:
    """An evidence bundle (`export_bundle`'s `scope`) as a zip, in a folder `top`
    with the verifier and a README that says it holds `holding`: a temporary file, read
    from its start and gone once closed. On disk, not in memory: an intent's event
    carries its approval evidence, up to a request's 256 KiB, and a bundle from the
    console may hold a thousand."""
    source = Path(__file__).resolve().parent.parent
    # Open for the caller, who closes it (a FileResponse does, once it is sent).
    archived = tempfile.TemporaryFile()  # noqa: SIM115
    try:
        with (
            tempfile.TemporaryDirectory() as exported,
            zipfile.ZipFile(archived, "w", zipfile.ZIP_DEFLATED) as archive,
        ):
            export_bundle(Path(exported), **scope)
            for path in sorted(Path(exported).iterdir()):
                archive.write(path, f"{top}/{path.name}")
            for name in VERIFIER_FILES:
                archive.write(source / name, f"{top}/{name}")
            exported_at = timezone.now().strftime("%Y-%m-%d %H:%M")
            archive.writestr(
                f"{top}/README.txt", ARCHIVE_README.format(holding=holding, exported=exported_at)
            )
    except BaseException:
        archived.close()  # nobody else will: the caller never gets it
        raise
    archived.seek(0)
    return archived
