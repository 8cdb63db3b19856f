"""An exported evidence bundle verifies offline; one changed byte fails it."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client

from ledger import chain
from ledger import views as ledger_views
from ledger.integrity import seal_events
from ledger.models import Capability
from ledger.tasks import anchor_hashes, seal_new_events
from ledger.verify_bundle import merkle_root, sha256
from tests.conftest import AnchorStore, Api, TimestampAuthority, person, serving_authority

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bundle(api: Api, refund: Capability, tmp_path: Path) -> Path:
    for n in (1, 2):
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        api.outcome(f"inv-{n}", "a1", kind="succeeded", business_reference=f"RF-{n}")
    seal_events()
    api.intent(invocation_id="inv-3", idempotency_key="k-3")  # not sealed yet
    folder = tmp_path / "bundle"
    call_command("export_bundle", str(folder))
    return folder


def verify(folder: Path, *seals: str) -> subprocess.CompletedProcess[str]:
    """The standalone command, in a Python with nothing but the standard library, given
    seal hashes (`--seal`)."""
    return verify_with(folder, *[arg for seal in seals for arg in ("--seal", seal)])


def verify_with(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-m", "ledger.verify_bundle", str(folder), *args],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip


def forge(folder: Path, name: str, text: str) -> None:
    """Rewrite one of the bundle's files, and its manifest to match, as a forger would."""
    (folder / name).write_text(text)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def downloaded(response: Any) -> bytes:
    """A download's bytes: the archive is streamed from a temporary file."""
    return b"".join(response.streaming_content)


def bundled(content: bytes, name: str) -> str:
    """One file of a downloaded bundle."""
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        (path,) = [path for path in archive.namelist() if path.endswith(f"/{name}")]
        return archive.read(path).decode()


def test_an_exported_bundle_verifies_offline(bundle: Path) -> None:
    result = verify(bundle)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "OK: 7 events and 1 seal verified"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["files"]) == {"events.jsonl", "seals.jsonl"}


def test_one_changed_byte_fails_it(bundle: Path) -> None:
    events = bundle / "events.jsonl"
    raw = bytearray(events.read_bytes())
    position = raw.index(b"RF-1")
    raw[position + 3] = ord("7")
    events.write_bytes(bytes(raw))
    result = verify(bundle)
    assert result.returncode == 1
    assert "events.jsonl: sha256" in result.stdout


def test_a_consistent_forgery_still_breaks_the_chain(bundle: Path) -> None:
    """Change an event and rewrite the manifest to match: the hashes give it away."""
    events = (bundle / "events.jsonl").read_text()
    forge(bundle, "events.jsonl", events.replace("RF-1", "RF-9"))
    result = verify(bundle)
    assert result.returncode == 1
    assert "invocation inv-1 event #3: hash" in result.stdout


def test_a_history_no_rule_leads_to_fails_it_hashes_and_all(bundle: Path) -> None:
    """An unsealed event's state rewritten, its hash and the manifest recomputed: every
    hash checks out, and the replay through the retry policy finds it."""
    records = [json.loads(line) for line in (bundle / "events.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if json.loads(r["body"])["invocation_id"] == "inv-3"]
    body = json.loads(record["body"])
    body["data"]["state"]["status"] = "succeeded"
    record["body"] = chain.canonical(body).decode()
    record["hash"] = sha256(body["prev_hash"].encode() + record["body"].encode())
    forge(bundle, "events.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    result = verify(bundle)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "FAIL invocation inv-3 event #1: expected a step of the retry policy from status "
        "recorded, attempts 0, found intent_recorded recording status succeeded, attempts 0"
    ]


def test_one_invocations_bundle_carries_its_whole_chain(bundle: Path, tmp_path: Path) -> None:
    folder = tmp_path / "one"
    call_command("export_bundle", str(folder), invocation="inv-2")
    result = verify(folder)
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines()[0] == "OK: 3 events and 1 seal verified"


def test_a_chain_sealed_in_seals_apart_verifies(bundle: Path, api: Api, tmp_path: Path) -> None:
    """inv-1's last event is sealed two seals after its first ones, with inv-3's seal
    between: the bundle must carry that seal too, or the seal chain looks broken."""
    assert seal_events() is not None  # inv-3's intent
    status, _ = api.outcome("inv-1", "a1", kind="business_failed")  # kept as evidence
    assert status == 409
    assert seal_events() is not None  # inv-1's outcome_conflict event
    folder = tmp_path / "apart"
    call_command("export_bundle", str(folder), invocation="inv-1")
    result = verify(folder)
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines()[0] == "OK: 4 events and 3 seals verified"
    between = json.loads((folder / "seals.jsonl").read_text().splitlines()[1])
    assert between["leaves"] is None  # inv-3's seal: its hash and body, not its events

    # Forge the seal between, manifest and all: its hash gives it away.
    lines = (folder / "seals.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('\\"event_count\\":1', '\\"event_count\\":2')
    assert lines[1] != json.dumps(between)
    forge(folder, "seals.jsonl", "\n".join(lines) + "\n")
    forged = verify(folder)
    assert forged.returncode == 1
    assert "its hash does not match its body" in forged.stdout


def test_a_logged_seal_anchors_the_bundle_against_a_whole_forgery(
    api: Api, refund: Capability, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A forger who recomputes every hash, root, seal and the manifest gets a bundle
    that checks on its own; the seal hash the ledger logged gives it away."""
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    with caplog.at_level(logging.INFO, logger="ledger.tasks"):
        assert seal_new_events.run() == 3
    logged = re.search(
        r"sealed first_sequence=1 last_sequence=3 .* hash=([0-9a-f]{64})", caplog.text
    )
    assert logged is not None
    folder = tmp_path / "bundle"
    call_command("export_bundle", str(folder))
    assert verify(folder).stdout.splitlines()[1].startswith("not anchored")
    anchored = verify(folder, logged.group(1))
    assert anchored.returncode == 0, anchored.stdout
    assert (
        anchored.stdout.splitlines()[1] == "anchored: 3 of 3 events are sealed by the given seal(s)"
    )

    forge_everything(folder)
    assert verify(folder).returncode == 0  # consistent on its own
    caught = verify(folder, logged.group(1))
    assert caught.returncode == 1
    assert f"seal {logged.group(1)[:12]} is not in this bundle's seal chain" in caught.stdout


def test_a_bundle_reaches_the_seal_its_anchor_store_holds(
    api: Api, refund: Capability, tmp_path: Path, anchor_store: AnchorStore, settings: Any
) -> None:
    """inv-1 is sealed first; the seal sent to the anchor store afterwards seals only
    another invocation's events. The bundle of inv-1 carries the seals up to that one,
    and says where it was sent, so that the hash the store holds anchors it."""
    settings.LEDGER_ANCHOR_URL = anchor_store.url
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    assert seal_new_events.run() == 3
    api.intent(invocation_id="inv-2", idempotency_key="k-2")
    assert seal_new_events.run() == 1
    assert anchor_hashes.run() is True
    stores_copy = anchor_store.received[-1][1]["seal"]["hash"]
    folder = tmp_path / "bundle"
    call_command("export_bundle", str(folder), "--invocation", "inv-1")

    seals = [json.loads(line) for line in (folder / "seals.jsonl").read_text().splitlines()]
    assert [seal["hash"] for seal in seals][-1] == stores_copy
    assert seals[-1]["leaves"] is None  # inv-2's events are not in the bundle
    unanchored = verify(folder).stdout.splitlines()
    assert unanchored[2].startswith(
        f"the ledger says it sent seal {stores_copy} to {anchor_store.url} at "
    )
    assert unanchored[2].endswith(
        "(receipt 'record-1'): ask that store for it, and pass the store's copy"
    )
    anchored = verify(folder, stores_copy)
    assert anchored.returncode == 0, anchored.stdout
    assert anchored.stdout.splitlines()[1] == (
        "anchored: 3 of 3 events are sealed by the given seal(s)"
    )
    (folder / "anchors.jsonl").write_text("{}\n")  # the file is in the manifest
    assert "anchors.jsonl: sha256" in verify(folder).stdout


def test_a_bundle_without_a_timestamp_token_is_not_taken_as_timestamped(
    bundle: Path, tmp_path: Path
) -> None:
    (tmp_path / "roots.pem").write_text("")
    checked = verify_with(bundle, "--tsa-roots", str(tmp_path / "roots.pem"))
    assert checked.returncode == 1
    assert "FAIL --tsa-roots given, but this bundle carries no timestamp token" in checked.stdout


def test_a_time_stamping_authoritys_token_anchors_the_bundle_offline(
    api: Api, refund: Capability, tmp_path: Path, authority: TimestampAuthority
) -> None:
    """The bundle carries the authority's token and the message it signed: with the
    authority's root certificate, OpenSSL checks the signature and the seal the message
    names anchors the bundle, no store's copy asked for. Under another root, or with
    the message rewritten to name a forged seal, it does not."""
    api.intent(invocation_id="inv-1", idempotency_key="k-1", attempt_id="a1")
    api.outcome("inv-1", "a1", kind="succeeded", business_reference="RF-1")
    assert seal_new_events.run() == 3
    assert anchor_hashes.run() is True
    folder = tmp_path / "bundle"
    call_command("export_bundle", str(folder), "--invocation", "inv-1")
    (seal,) = [json.loads(line) for line in (folder / "seals.jsonl").read_text().splitlines()]

    unanchored = verify(folder).stdout.splitlines()
    assert unanchored[2].startswith(
        f"a time-stamping authority ({authority.url}) signed seal {seal['hash']} (genTime "
    )
    anchored = verify_with(folder, "--tsa-roots", str(authority.roots))
    assert anchored.returncode == 0, anchored.stdout
    assert anchored.stdout.splitlines()[1:] == [
        f"timestamped: the authority's token of seal {seal['hash']} verifies",
        "anchored: 3 of 3 events are sealed by the given seal(s)",
    ]

    with serving_authority(tmp_path / "other") as other:
        refused = verify_with(folder, "--tsa-roots", str(other.roots))
    assert refused.returncode == 1
    assert f"FAIL the timestamp token of seal {seal['hash'][:12]} does not verify: " in (
        refused.stdout
    )
    message = json.loads((folder / "anchor-message.json").read_text())
    message["seal"]["hash"] = "9" * 64
    forge(folder, "anchor-message.json", json.dumps(message))
    forged = verify_with(folder, "--tsa-roots", str(authority.roots))
    assert forged.returncode == 1
    assert f"FAIL the timestamp token of seal {seal['hash'][:12]} does not verify: " in (
        forged.stdout
    )


def forge_everything(folder: Path) -> None:
    """inv-1's refund reference rewritten, with every hash that commits to it."""
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    (seal,) = [json.loads(line) for line in (folder / "seals.jsonl").read_text().splitlines()]
    forged = next(e for e in events if "RF-1" in e["body"] and '"seq":3' in e["body"])
    body = json.loads(forged["body"])
    forged["body"] = forged["body"].replace("RF-1", "RF-9")
    old_hash, forged["hash"] = (
        forged["hash"],
        sha256(body["prev_hash"].encode() + forged["body"].encode()),
    )
    seal["leaves"] = [forged["hash"] if leaf == old_hash else leaf for leaf in seal["leaves"]]
    seal_body = json.loads(seal["body"])
    seal_body["merkle_root"] = merkle_root(seal["leaves"])
    seal["body"] = json.dumps(seal_body, separators=(",", ":"), sort_keys=True)
    old_seal, seal["hash"] = (
        seal["hash"],
        sha256(seal_body["prev_hash"].encode() + seal["body"].encode()),
    )
    for event in events:
        if event["seal"] == old_seal:
            event["seal"] = seal["hash"]
    forge(folder, "events.jsonl", "".join(json.dumps(e) + "\n" for e in events))
    forge(folder, "seals.jsonl", json.dumps(seal) + "\n")


def test_the_console_hands_over_one_invocations_bundle_with_its_verifier(
    bundle: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Compliance downloads an invocation's bundle from its page: a zip that checks with
    the verifier inside it, in a Python with nothing installed, or with a checkout's."""
    reviewer = person("cora", "compliance")
    page = reviewer.get("/invocations/inv-2/").content.decode()
    assert 'href="/invocations/inv-2/bundle.zip"' in page
    response = reviewer.get("/invocations/inv-2/bundle.zip")
    assert response.status_code == 200 and response["Content-Type"] == "application/zip"
    assert response["Content-Disposition"] == 'attachment; filename="evidence-inv-2.zip"'
    assert 'evidence exported by=user:cora what="bundle of invocation inv-2"' in caplog.text
    archive = tmp_path / "evidence-inv-2.zip"
    archive.write_bytes(downloaded(response))
    with zipfile.ZipFile(archive) as opened:
        names = set(opened.namelist())
        opened.extractall(tmp_path / "received")
    assert names == {
        f"evidence-inv-2/{name}"
        for name in ("manifest.json", "events.jsonl", "seals.jsonl", "README.txt",
                     "ledger/__init__.py", "ledger/policy.py", "ledger/verify_bundle.py")
    }  # fmt: skip

    received = subprocess.run(
        [sys.executable, "-S", "-m", "ledger.verify_bundle", "."],
        cwd=tmp_path / "received" / "evidence-inv-2", capture_output=True, text=True,
    )  # fmt: skip
    assert received.returncode == 0, received.stdout + received.stderr
    assert received.stdout.splitlines()[0] == "OK: 3 events and 1 seal verified"
    assert verify(archive).stdout.splitlines()[0] == "OK: 3 events and 1 seal verified"


# The oldest Python the bundle's README names; Debian 12's own python3.
OLDEST_PYTHON = Path("/usr/bin/python3.11")


@pytest.mark.skipif(
    not OLDEST_PYTHON.exists(),
    reason="needs Debian's Python 3.11 at /usr/bin/python3.11 (apt-get install python3.11)",
)
def test_a_received_bundle_checks_with_the_oldest_python_its_readme_names(
    bundle: Path, tmp_path: Path
) -> None:
    content = downloaded(person("cora", "compliance").get("/invocations/inv-2/bundle.zip"))
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        archive.extractall(tmp_path)
        assert "with Python 3.11 or later" in archive.read("evidence-inv-2/README.txt").decode()
    received = subprocess.run(
        [str(OLDEST_PYTHON), "-S", "-m", "ledger.verify_bundle", "."],
        cwd=tmp_path / "evidence-inv-2", capture_output=True, text=True,
    )  # fmt: skip
    assert received.returncode == 0, received.stdout + received.stderr
    assert received.stdout.splitlines()[0] == "OK: 3 events and 1 seal verified"


def test_a_downloaded_bundle_changed_by_one_byte_fails(bundle: Path, tmp_path: Path) -> None:
    content = downloaded(person("cora", "compliance").get("/invocations/inv-2/bundle.zip"))
    changed = tmp_path / "changed.zip"
    with zipfile.ZipFile(io.BytesIO(content)) as original, zipfile.ZipFile(changed, "w") as out:
        for item in original.infolist():
            data = original.read(item)
            if item.filename.endswith("events.jsonl"):
                data = data.replace(b'"kind\\":\\"succeeded', b'"kind\\":\\"business_failed', 1)
                assert data != original.read(item)
            out.writestr(item, data)
    result = verify(changed)
    assert result.returncode == 1
    assert result.stdout.startswith("FAIL events.jsonl: sha256 ")


def test_a_bundle_of_no_invocation_or_no_bundle_is_refused(
    bundle: Path, api: Api, tmp_path: Path
) -> None:
    assert person("cora", "compliance").get("/invocations/inv-9/bundle.zip").status_code == 404
    response = Client().get("/invocations/inv-2/bundle.zip", headers=api.headers())
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    result = verify(tmp_path)
    assert (result.returncode, result.stdout) == (
        1, f"FAIL {tmp_path}: no manifest.json, not an evidence bundle\n"
    )  # fmt: skip


def test_the_audit_search_hands_over_the_bundle_of_what_it_finds(
    bundle: Path, api: Api, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.intent(invocation_id="inv-x", idempotency_key="k-x", capability="pay.other")
    reviewer = person("cora", "compliance")
    page = reviewer.get("/audit/", {"capability": "refund.create"}).content.decode()
    assert 'href="/audit/bundle.zip?capability=refund.create"' in page

    response = reviewer.get("/audit/bundle.zip", {"capability": "refund.create"})

    assert response.status_code == 200 and response["Content-Type"] == "application/zip"
    assert re.fullmatch(
        r'attachment; filename="evidence-search-\d{8}T\d{6}\.zip"', response["Content-Disposition"]
    )
    content = downloaded(response)
    archive = tmp_path / "search.zip"
    archive.write_bytes(content)
    result = verify(archive)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "OK: 7 events and 1 seal verified"
    events = [json.loads(line) for line in bundled(content, "events.jsonl").splitlines()]
    assert {json.loads(e["body"])["invocation_id"] for e in events} == {"inv-1", "inv-2", "inv-3"}
    manifest = json.loads(bundled(content, "manifest.json"))
    assert manifest["scope"]["search"] == {"capability": "refund.create"}
    holding = "the 3 invocations an audit search found (capability=refund.create)"
    assert holding in bundled(content, "README.txt")
    assert f'evidence exported by=user:cora what="bundle of {holding}"' in caplog.text


def test_a_search_bundle_of_too_many_or_none_or_a_bad_filter_is_refused(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reviewer = person("cora", "compliance")
    monkeypatch.setattr(ledger_views, "BUNDLE_MAX_INVOCATIONS", 2)
    too_many = reviewer.get("/audit/bundle.zip")
    assert too_many.status_code == 400
    assert "This search finds more than 2 invocations" in too_many.content.decode()
    assert reviewer.get("/audit/bundle.zip", {"task_id": "t-none"}).content.decode() == (
        "This search finds no invocation: there is nothing to bundle."
    )
    bad = reviewer.get("/audit/bundle.zip", {"since": "yesterday-ish"})
    assert bad.status_code == 400 and "since" in bad.content.decode()
    assert reviewer.get("/audit/bundle.zip", {"invocation_id": "inv-2"}).status_code == 200
