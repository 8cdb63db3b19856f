"""Verify an evidence bundle offline — Python 3.11 or later, its standard library only.

    python -m ledger.verify_bundle BUNDLE_DIR     # or the console's evidence-....zip

A bundle (`manage.py export_bundle`, or the console's zip of an invocation or of an
audit search) holds:

- manifest.json   the SHA-256 of every other file;
- events.jsonl    per event: its hashed body (RFC 8785 canonical JSON, as a string),
                  its hash, and its place in the global order (sequence, seal);
- seals.jsonl     per covering seal: its hashed body, its hash, and the hashes of
                  every event it sealed, in order (no other event data); and every
                  seal between covering ones, with its body and hash only (leaves
                  null), so that the seal chain is whole, up to the seal the ledger
                  sent to its anchor store after them, when it did;
- anchors.jsonl   (when it did) that seal's hash, the store and its receipt; and
                  when the store is a time-stamping authority (RFC 3161), the names
                  of its token (anchor-token.tsr) and of the message it signed
                  (anchor-message.json), which names the seal.

It checks the manifest, every event hash and chain link (per invocation, from its
first event), every seal's hash, chain and Merkle root, and that each event sits in
its seal where the bundle says; and it replays each intact chain's recorded states
through the ledger's retry policy (`ledger/policy.py`, standard library too), so that
a history no rule leads to is found. Prints OK or each failure; exit status 1 on
failure.

All of that a forger could recompute. What ties a bundle to the ledger is a seal hash
kept outside it: the ledger logs each seal's hash as it makes it (`sealed ...
hash=...`), and may send them to a store (anchors.jsonl says where; take the hash from
the store, not from the file). `--seal HASH` (repeatable) requires that seal in the
bundle's chain, and
the events sealed by it or by the seals it chains to are then anchored:

    python -m ledger.verify_bundle BUNDLE_DIR --seal 3f1c...

A time-stamping authority's token needs no one's copy: `--tsa-roots ROOTS.pem`, the
authority's root certificates, has OpenSSL (`openssl ts -verify`) check its signature
over the message, and the seal the message names anchors the bundle as `--seal` would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ledger import policy

GENESIS = "0" * 64


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def merkle_root(leaves: Iterable[str]) -> str:
    level = [bytes.fromhex(leaf) for leaf in leaves]
    if not level:
        return sha256(b"")
    while len(level) > 1:
        if len(level) % 2:
            level.append(level[-1])
        level = [
            hashlib.sha256(a + b).digest() for a, b in zip(level[::2], level[1::2], strict=True)
        ]
    return level[0].hex()


def _lines(path: Path | zipfile.Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def opened(path: Path) -> Path | zipfile.Path:
    """The folder holding the bundle's manifest: `path`, or in a zip archive its top
    folder (or its root)."""
    if not zipfile.is_zipfile(path):
        return path
    root = zipfile.Path(path)
    folders = [entry for entry in root.iterdir() if entry.is_dir()]
    return next((f for f in folders if (f / "manifest.json").exists()), root)


def verify(folder: Path | zipfile.Path, trusted: Iterable[str] = ()) -> tuple[list[str], int]:
    """Each problem found, and how many events the trusted seals anchor."""
    problems: list[str] = []
    manifest = json.loads((folder / "manifest.json").read_text())
    for name, expected in manifest["files"].items():
        found = sha256((folder / name).read_bytes())
        if found != expected:
            problems.append(f"{name}: sha256 {found}, manifest says {expected}")
    if problems:
        return problems, 0  # nothing else in an altered file can be trusted

    heads: dict[str, tuple[int, str]] = {}
    placed: dict[str, tuple[int, str]] = {}
    histories: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
    broken: set[str] = set()  # a broken chain is reported as such, not replayed
    for record in _lines(folder / "events.jsonl"):
        body = json.loads(record["body"])
        where = f"invocation {body['invocation_id']} event #{body['seq']}"
        found_before = len(problems)
        history = histories.setdefault(body["invocation_id"], [])
        history.append((body["seq"], body["kind"], body["data"]))
        seq, prev = heads.get(body["invocation_id"], (0, GENESIS))
        if body["seq"] != seq + 1:
            problems.append(f"{where}: expected event #{seq + 1}")
        elif body["prev_hash"] != prev:
            problems.append(f"{where}: prev_hash {body['prev_hash']}, chain has {prev}")
        computed = sha256(body["prev_hash"].encode() + record["body"].encode())
        if computed != record["hash"]:
            problems.append(f"{where}: hash {record['hash']}, body hashes to {computed}")
        if len(problems) > found_before:
            broken.add(body["invocation_id"])
        heads[body["invocation_id"]] = (body["seq"], record["hash"])
        if record.get("sequence") is not None:
            placed[record["hash"]] = (record["sequence"], record["seal"])

    for invocation_id, history in histories.items():
        unexplained = None if invocation_id in broken else policy.replay(history)
        if unexplained is not None:
            problems.append(
                f"invocation {invocation_id} event #{unexplained.seq}: expected "
                f"{unexplained.expected}, found {unexplained.found}"
            )

    prev_seal = None
    chain: list[str] = []  # the bundle's seal hashes, oldest first
    for seal in _lines(folder / "seals.jsonl"):
        chain.append(seal["hash"])
        body = json.loads(seal["body"])
        where = f"seal {seal['hash'][:12]} ({body['first_sequence']}-{body['last_sequence']})"
        if sha256(body["prev_hash"].encode() + seal["body"].encode()) != seal["hash"]:
            problems.append(f"{where}: its hash does not match its body")
        if prev_seal is not None and body["prev_hash"] != prev_seal:
            problems.append(f"{where}: does not chain to the seal before it")
        prev_seal = seal["hash"]
        if seal["leaves"] is None:
            continue  # a seal between covering ones: in the chain, sealing none of these events
        if (
            merkle_root(seal["leaves"]) != body["merkle_root"]
            or len(seal["leaves"]) != body["event_count"]
        ):
            problems.append(f"{where}: the Merkle root does not cover its events")
        for offset, leaf in enumerate(seal["leaves"]):
            if leaf in placed and placed[leaf] != (body["first_sequence"] + offset, seal["hash"]):
                problems.append(f"{where}: event {leaf[:12]} is not where the bundle puts it")
    sealed = {leaf for seal in _lines(folder / "seals.jsonl") for leaf in seal["leaves"] or ()}
    for leaf, (sequence, _) in placed.items():
        if leaf not in sealed:
            problems.append(f"event {leaf[:12]} (sequence {sequence}) is in no bundled seal")
    anchored_seals: set[str] = set()
    for hash_ in trusted:
        if hash_ not in chain:
            problems.append(f"seal {hash_[:12]} is not in this bundle's seal chain")
            continue
        # A seal commits to every seal before it (prev_hash) and to its own events.
        anchored_seals.update(chain[: chain.index(hash_) + 1])
    anchored = sum(1 for _, seal_hash in placed.values() if seal_hash in anchored_seals)
    return problems, anchored


def timestamped_seals(folder: Path | zipfile.Path, roots: Path) -> tuple[list[str], list[str]]:
    """The seals named by the messages whose time-stamping authority's tokens OpenSSL
    verifies under `roots`, and the problems with the others."""
    anchored, problems = [], []
    openssl = shutil.which("openssl")
    for sent in _lines(folder / "anchors.jsonl") if (folder / "anchors.jsonl").exists() else []:
        if "token" not in sent:
            continue
        if openssl is None:
            problems.append("openssl is not installed: the timestamp token is not checked")
            continue
        with tempfile.TemporaryDirectory() as copies:  # a zip's files, for OpenSSL to read
            message, token = Path(copies, "message"), Path(copies, "token")
            message.write_bytes((folder / sent["message"]).read_bytes())
            token.write_bytes((folder / sent["token"]).read_bytes())
            checked = subprocess.run(
                [openssl, "ts", "-verify", "-data", message, "-in", token, "-CAfile", roots],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            try:
                named = json.loads(message.read_bytes())["seal"]
            except (ValueError, KeyError, TypeError):
                named = None
        if "Verification: OK" not in checked.stdout:
            why = (checked.stderr or checked.stdout).strip().splitlines()
            problems.append(f"the timestamp token of seal {sent['seal'][:12]} does not verify: "
                            f"{why[-1] if why else checked.returncode}")  # fmt: skip
        elif named is None or named["hash"] != sent["seal"]:
            problems.append(f"the timestamped message names another seal than {sent['seal']}")
        else:
            anchored.append(named["hash"])
    if not anchored and not problems:
        problems.append("--tsa-roots given, but this bundle carries no timestamp token")
    return anchored, problems


def _counted(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ledger.verify_bundle")
    parser.add_argument("bundle", type=Path)
    parser.add_argument(
        "--seal",
        action="append",
        default=[],
        metavar="HASH",
        help="a seal hash from the ledger's log; the bundle's events it seals are anchored",
    )
    parser.add_argument(
        "--tsa-roots",
        type=Path,
        metavar="PEM",
        help="the time-stamping authority's root certificates: its token anchors the bundle",
    )
    args = parser.parse_args(argv)
    bundle = opened(args.bundle)
    if not (bundle / "manifest.json").exists():
        print(f"FAIL {args.bundle}: no manifest.json, not an evidence bundle")
        return 1
    timestamped, problems = (
        timestamped_seals(bundle, args.tsa_roots) if args.tsa_roots else ([], [])
    )
    args.seal += timestamped
    found, anchored = verify(bundle, args.seal)
    problems += found
    for problem in problems:
        print(f"FAIL {problem}")
    if problems:
        return 1
    events = len(_lines(bundle / "events.jsonl"))
    seals = len(_lines(bundle / "seals.jsonl"))
    print(f"OK: {_counted(events, 'event')} and {_counted(seals, 'seal')} verified")
    if timestamped:
        print(f"timestamped: the authority's token of seal {timestamped[0]} verifies")
    if args.seal:
        print(f"anchored: {anchored} of {events} events are sealed by the given seal(s)")
    else:
        print("not anchored: pass --seal HASH, a seal hash from the ledger's log")
        if (bundle / "anchors.jsonl").exists():
            for sent in _lines(bundle / "anchors.jsonl"):
                if "token" in sent:
                    print(
                        f"a time-stamping authority ({sent['url']}) signed seal {sent['seal']} "
                        f"({sent['receipt']}): pass --tsa-roots with its root certificates"
                    )
                    continue
                print(
                    f"the ledger says it sent seal {sent['seal']} to {sent['url']} at "
                    f"{sent['sent_at']} (receipt {sent['receipt'][:80]!r}): ask that store "
                    "for it, and pass the store's copy"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
