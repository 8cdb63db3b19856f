"""`python -m ledger.client flush SPOOL --url URL --token TOKEN`: deliver a spool."""

from __future__ import annotations

import argparse
import os
import sys

from ledger.client.runtime import LedgerClient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ledger.client")
    commands = parser.add_subparsers(dest="command", required=True)
    flush = commands.add_parser("flush", help="deliver the outcomes kept in a spool file")
    flush.add_argument("spool")
    flush.add_argument("--url", default=os.environ.get("LEDGER_URL", "http://127.0.0.1:8000"))
    flush.add_argument("--token", default=os.environ.get("LEDGER_TOKEN"))
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("--token (or LEDGER_TOKEN) is required")
    client = LedgerClient(args.url, args.token, spool=args.spool)
    report = client.flush()
    print(f"delivered {report.delivered}, remaining {report.remaining}")
    for line in report.damaged:
        print(f"damaged (kept in {args.spool}.damaged): {line}")
    for line in report.refused:
        print(f"refused (kept in {args.spool}.refused): {line}")
    if report.stopped_by:
        print(f"stopped: {report.stopped_by}")
    return 0 if not (report.remaining or report.damaged or report.refused) else 1


if __name__ == "__main__":
    sys.exit(main())
