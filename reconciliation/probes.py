"""Read-only probes: ask the business system whether an effect happened.

A probe never dispatches a business operation. It is configured per capability
(`Capability.probe`) as one of:

    {"kind": "none"}                                   escalate to a person at once
    {"kind": "python", "callable": "pkg.module.func"}  allow-listed in LEDGER_PYTHON_PROBES
                                                       ("timeout": how long it is waited for)
    {"kind": "http",
     "url": "https://pay.example/refunds?idempotency_key={idempotency_key}",
     "headers": {"Authorization": "Bearer {secret:PAYMENTS}"},
     "tls": "PAYMENTS",
     "connect_timeout": 2, "read_timeout": 5,
     "present": {"status": 200, "json_path": "status", "equals": "succeeded",
                 "reference_path": "id"},
     "absent": {"status": 404, "json_path": "error", "equals": "refund_not_found"}}

The admin checks a configuration when it is saved (ledger/probe_config.py).
URL templates may use {idempotency_key}, {invocation_id} and {business_reference}
(URL-quoted). `{secret:NAME}` in a header comes from the setting LEDGER_PROBE_SECRETS
(environment LEDGER_PROBE_SECRET_NAME) and is never stored or logged; "tls" names the
business system's own CA and client certificate files (tls_files). Anything that
is not clearly present or absent — timeouts, 5xx, bodies that do not parse,
redirects (never followed), a reference that is not a string or a number — is
inconclusive.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import hashlib
import http.cookiejar
import importlib
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
from django.conf import settings
from django.db import connections

from ledger import outbound
from ledger.models import Invocation
from ledger.probe_config import SECRET, UNIDENTIFIED, URL_PLACEHOLDERS, identifies

log = logging.getLogger(__name__)


class Finding(StrEnum):
    PRESENT = "effect_present"
    ABSENT = "effect_absent"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class ProbeResult:
    finding: Finding
    business_reference: str = ""
    detail: str = ""
    # What was asked and answered, without secrets: for the event.
    summary: dict[str, Any] = field(default_factory=dict)
    duration_ms: int = 0
    # Seconds the business system asked the ledger to wait before asking again (a 429's
    # or 503's Retry-After): the next probe waits at least that long.
    retry_after: float = 0.0


class ProbeConfigError(ValueError):
    pass


PLACEHOLDER = re.compile(r"\{(" + "|".join(URL_PLACEHOLDERS) + r")\}")


class NothingToAskBy(Exception):
    """The URL names a value the invocation does not have (no business reference was
    recorded): asking by an empty one would ask about nothing in particular."""


def _fill(template: str, invocation: Invocation) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name == "business_reference":  # read only for a URL that names it
            found = _last_reference(invocation)
        else:
            found = getattr(invocation, name)
        if not found:
            raise NothingToAskBy(f"no {name} recorded to ask by")
        return quote(found, safe="")

    return PLACEHOLDER.sub(value, template)


def _last_reference(invocation: Invocation) -> str:
    if invocation.pk is None:  # a key tried from the console: no evidence of its own
        return ""
    outcome = (
        invocation.attempts.exclude(outcome__business_reference="")
        .order_by("-number")
        .values_list("outcome__business_reference", flat=True)
        .first()
    )
    return outcome or ""


def _secret_headers(headers: Mapping[str, str]) -> dict[str, str]:
    secrets: Mapping[str, str] = settings.LEDGER_PROBE_SECRETS
    filled = {}
    for name, value in headers.items():

        def secret(match: re.Match[str]) -> str:
            if match.group(1) not in secrets:
                raise ProbeConfigError(f"secret {match.group(1)!r} is not configured")
            return secrets[match.group(1)]

        filled[name] = SECRET.sub(secret, value)
    return filled


def _json_path(body: Any, path: str) -> Any:
    node = body
    for part in path.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            raise KeyError(path)
    return node


def _rule_matches(rule: Mapping[str, Any], response: httpx.Response) -> bool:
    """Whether the answer has the rule's status and, in its JSON, the rule's path (with
    the value it `equals`). A path the answer lacks is not a match: a search's empty
    `{"data": []}` has no `data.0.status` for the present rule, and is for the absent
    one to read."""
    if response.status_code != rule.get("status"):
        return False
    if "json_path" not in rule:
        return True
    try:
        value = _json_path(response.json(), rule["json_path"])
    except KeyError:
        return False
    return "equals" not in rule or _same(value, rule["equals"])


def _same(value: Any, expected: Any) -> bool:
    """Equal as JSON values: Python takes False for 0 and True for 1, JSON does not (its
    numbers are equal whatever their spelling: 1 and 1.0)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return type(value) is type(expected) and value == expected
    if isinstance(value, dict) and isinstance(expected, dict):
        return value.keys() == expected.keys() and all(_same(value[k], expected[k]) for k in value)
    if isinstance(value, list) and isinstance(expected, list):
        return len(value) == len(expected) and all(map(_same, value, expected))
    return bool(value == expected)


REFERENCE_LENGTH = 256  # as a runtime's business_reference


def _reference(response: httpx.Response, path: str) -> str:
    """The business reference at `path`: a string or a number, as the API takes one
    from a runtime. Anything else (an object, a list, a long text) would be recorded
    as evidence nobody could use, so the answer does not count."""
    value = _json_path(response.json(), path)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"the reference at {path!r} is {type(value).__name__}, not a string")
    reference = str(value)
    if not reference or len(reference) > REFERENCE_LENGTH:
        raise ValueError(f"the reference at {path!r} is empty or over {REFERENCE_LENGTH} chars")
    return reference


_local = threading.local()

Stamp = tuple[int, int, int]


@dataclass(frozen=True)
class TlsFiles:
    """The files an https probe's TLS is made of, each as (the setting that names it,
    its path, its stamp: inode, size and modification time): CA certificates trusted
    besides httpx's (certifi's bundle, or the file SSL_CERT_FILE names), and the
    certificate with its key shown to a business system that asks for one (mutual
    TLS)."""

    ca_files: tuple[tuple[str, str, Stamp], ...] = ()
    client_cert: tuple[str, str, Stamp] | None = None

    @property
    def paths(self) -> tuple[tuple[str, str], ...]:
        files = (*self.ca_files, *([self.client_cert] if self.client_cert else []))
        return tuple((setting, path) for setting, path, _ in files)


def tls_files(config: Mapping[str, Any]) -> TlsFiles:
    """The TLS files of a probe: LEDGER_PROBE_CA_FILE and LEDGER_PROBE_CLIENT_CERT, and
    with `"tls": "PAYMENTS"` LEDGER_PROBE_CA_FILE_PAYMENTS (trusted too) and
    LEDGER_PROBE_CLIENT_CERT_PAYMENTS (shown instead): each business system may have a
    CA, and give the ledger a certificate, of its own.

    A file is known by its contents' inode, size and modification time too, so that a
    certificate renewed in place is read by the next probe, not after the workers'
    restart."""
    ca_files = [("LEDGER_PROBE_CA_FILE", settings.LEDGER_PROBE_CA_FILE)]
    client_cert = ("LEDGER_PROBE_CLIENT_CERT", settings.LEDGER_PROBE_CLIENT_CERT)
    name = config.get("tls")
    if name:
        named_ca = settings.LEDGER_PROBE_CA_FILES.get(name, "")
        named_cert = settings.LEDGER_PROBE_CLIENT_CERTS.get(name, "")
        if not named_ca and not named_cert:
            raise ProbeConfigError(
                f"tls {name!r} is not configured: set LEDGER_PROBE_CA_FILE_{name} or "
                f"LEDGER_PROBE_CLIENT_CERT_{name}"
            )
        ca_files.append((f"LEDGER_PROBE_CA_FILE_{name}", named_ca))
        if named_cert:
            client_cert = (f"LEDGER_PROBE_CLIENT_CERT_{name}", named_cert)
    return TlsFiles(
        tuple(_stamped(*ca) for ca in ca_files if ca[1]),
        _stamped(*client_cert) if client_cert[1] else None,
    )


def _stamped(setting: str, path: str) -> tuple[str, str, Stamp]:
    try:
        found = os.stat(path)
        return setting, path, (found.st_ino, found.st_size, found.st_mtime_ns)
    except OSError as exc:
        raise ProbeConfigError(f"{setting} {path!r}: {exc}") from exc


def _http_client(tls: TlsFiles) -> httpx.Client:
    """This thread's HTTP client for probes with these TLS files.

    Building a client loads the CA bundle, which took ~60 ms here, far longer than a
    probe; each worker thread keeps one for each set of TLS files (a forked child
    builds its own rather than share its parent's connections). It keeps no cookies:
    one probe's answer must not change what the next one asks.
    """
    if getattr(_local, "pid", None) != os.getpid():
        _local.pid, _local.clients = os.getpid(), {}
    clients: dict[TlsFiles, httpx.Client] = _local.clients
    if tls not in clients:
        # A file renewed in place: the client built from its old contents goes.
        for stale in [built for built in clients if built.paths == tls.paths]:
            clients.pop(stale).close()
        no_cookies = http.cookiejar.DefaultCookiePolicy(allowed_domains=[])
        clients[tls] = outbound.reading_by_deadline(
            httpx.Client(
                follow_redirects=False,
                cookies=http.cookiejar.CookieJar(policy=no_cookies),
                verify=_tls_context(tls),
            )
        )
    return clients[tls]


def _tls_context(tls: TlsFiles) -> ssl.SSLContext | bool:
    if tls == TlsFiles():
        return True
    context = httpx.create_ssl_context()
    loads: list[tuple[tuple[str, str, Stamp], Callable[[str], object]]] = [
        (ca, context.load_verify_locations) for ca in tls.ca_files
    ]
    if tls.client_cert:
        loads.append((tls.client_cert, context.load_cert_chain))
    for (setting, path, _), load in loads:
        try:
            load(path)
        except (OSError, ssl.SSLError) as exc:
            raise ProbeConfigError(f"{setting} {path!r}: {exc}") from exc
    return context


USER_AGENT = "invocation-ledger-probe (read-only)"


# How long an http probe waits for a connection of its client's and to send its request.
SEND_SECONDS = 5.0
# What a claim keeps, after a probe's answer (or the wait for it), to record it.
RECORD_SECONDS = 5.0


def _timeouts(config: Mapping[str, Any]) -> tuple[float, float]:
    """An http probe's connect and read timeouts, in seconds."""
    return float(config.get("connect_timeout", 2)), float(config.get("read_timeout", 5))


def longest_run(config: Mapping[str, Any]) -> float:
    """The longest a probe can take, in seconds, and the time to record its answer. An
    http probe: its request sent (the waits for a connection, to connect, for the TLS
    handshake and to send) or its deadline (its connect and read timeouts from its
    start, which every read keeps), whichever is later. A python probe: the `timeout`
    its configuration declares (0 without one: it is waited for within the lease,
    python_wait)."""
    if config.get("kind") == "python":
        declared = float(config.get("timeout", 0))
        return declared + RECORD_SECONDS if declared else 0.0
    if config.get("kind") != "http":
        return 0.0
    connect, read = _timeouts(config)
    return max(2 * SEND_SECONDS + 2 * connect, connect + read) + RECORD_SECONDS


def http_probe(config: Mapping[str, Any], invocation: Invocation) -> ProbeResult:
    try:
        url = _fill(config["url"], invocation)
    except NothingToAskBy as exc:
        return ProbeResult(Finding.INCONCLUSIVE, detail=str(exc), summary={"method": "GET"})
    if urlsplit(url).scheme not in ("http", "https"):
        raise ProbeConfigError("an http probe needs an http(s) URL")
    summary: dict[str, Any] = {"method": "GET", "url": url}
    connect, read = _timeouts(config)
    timeout = httpx.Timeout(connect=connect, read=read, write=SEND_SECONDS, pool=SEND_SECONDS)
    # Rules read JSON: a business system that answers by the Accept header (HTML to a
    # browser's) is asked for it. Its people find the ledger's questions in their logs
    # by the User-Agent. The probe's own headers replace these, in any case.
    headers = httpx.Headers(
        {
            "Accept": "application/json",
            "Accept-Encoding": outbound.ACCEPT_ENCODING,
            "User-Agent": USER_AGENT,
        }
    )
    headers.update(_secret_headers(config.get("headers", {})))
    client = _http_client(tls_files(config))
    try:
        with (
            outbound.deadline(connect + read),
            client.stream("GET", url, headers=headers, timeout=timeout) as streamed,
        ):
            summary["status"] = streamed.status_code
            body = outbound.read_answer(streamed)
    except httpx.HTTPError as exc:
        # The reason as the network gave it ("Connection refused", "certificate verify
        # failed: …"): what an operator needs to tell a down system from a wrong CA.
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return ProbeResult(Finding.INCONCLUSIVE, detail=reason[:200], summary=summary)
    except outbound.UnreadAnswer as exc:
        return ProbeResult(Finding.INCONCLUSIVE, detail=str(exc), summary=summary)
    decoded_headers = [
        (name, value)
        for name, value in streamed.headers.multi_items()
        if name.lower() not in ("content-encoding", "content-length")
    ]
    response = httpx.Response(streamed.status_code, headers=decoded_headers, content=body)
    # Which answer the finding rests on, without keeping it (it may name a customer):
    # the business system's logs or exports can be matched against its digest.
    summary["answer"] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    if response.is_redirect:
        location = response.headers.get("location", "")
        return ProbeResult(
            Finding.INCONCLUSIVE, detail=f"redirect to {location!r} not followed", summary=summary
        )
    try:
        for name, finding in (("present", Finding.PRESENT), ("absent", Finding.ABSENT)):
            rule = config.get(name)
            if rule is None or not _rule_matches(rule, response):
                continue
            if not identifies(name, rule):  # saved before it was checked
                detail = f"misconfigured: {UNIDENTIFIED[name]}"
                return ProbeResult(Finding.INCONCLUSIVE, detail=detail, summary=summary)
            reference_path = rule.get("reference_path")
            reference = _reference(response, reference_path) if reference_path else ""
            # The rule as it decided: the capability's probe may be changed later.
            summary["rule"] = {"name": name, **rule}
            return ProbeResult(finding, business_reference=reference, summary=summary)
    except (ValueError, KeyError) as exc:
        return ProbeResult(
            Finding.INCONCLUSIVE, detail=f"unreadable response: {exc!r}"[:200], summary=summary
        )
    return ProbeResult(
        Finding.INCONCLUSIVE,
        detail=f"no rule matched status {response.status_code}",
        summary=summary,
        retry_after=retry_after_of(response),
    )


# The longest a business system's Retry-After may put the next probe off: its tries
# still run out (five at the defaults), and a person decides within hours, not days.
RETRY_AFTER_MAX_SECONDS = 3600.0


def retry_after_of(response: httpx.Response) -> float:
    """A 429's or 503's Retry-After, in seconds (given as seconds or as an HTTP date);
    0 when there is none or it does not parse."""
    value = response.headers.get("retry-after", "").strip()
    if response.status_code not in (429, 503) or not value:
        return 0.0
    if value.isdecimal():
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 0.0
        if when.tzinfo is None:
            return 0.0
        seconds = (when - dt.datetime.now(dt.UTC)).total_seconds()
    return _bounded(seconds)


def _bounded(seconds: Any) -> float:
    """A wait within 0 and RETRY_AFTER_MAX_SECONDS; 0 for what is not a number (a python
    probe's mistake must not stop its result being recorded)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds != seconds:
        return 0.0
    return min(max(float(seconds), 0.0), RETRY_AFTER_MAX_SECONDS)


def python_wait(config: Mapping[str, Any]) -> float:
    """How long a python probe's answer is waited for: its declared `timeout`, or most
    of the claim's lease (the rest to record what it found)."""
    return float(config.get("timeout") or 0.9 * settings.LEDGER_PROBE_LEASE_SECONDS)


def python_probe(
    config: Mapping[str, Any], invocation: Invocation, wait: float | None = None
) -> ProbeResult:
    dotted = config.get("callable", "")
    if dotted not in settings.LEDGER_PYTHON_PROBES:
        raise ProbeConfigError(f"{dotted!r} is not listed in LEDGER_PYTHON_PROBES")
    module, _, name = dotted.rpartition(".")
    func: Callable[[Invocation], ProbeResult] = getattr(importlib.import_module(module), name)
    limit = python_wait(config) if wait is None else min(wait, python_wait(config))
    return _answered_within(limit, func, invocation)


# Python probes that may run at once in a process, answered or not. A callable cannot
# be stopped from outside: one that never returns (a business system's client library
# without a timeout) keeps its thread. Waited for apart, it leaves the worker's thread
# free for the next probe; counted, it cannot take a thread for every invocation.
PYTHON_PROBES_AT_ONCE = 8
_python_slots = threading.BoundedSemaphore(PYTHON_PROBES_AT_ONCE)


def _answered_within(
    seconds: float, func: Callable[[Invocation], ProbeResult], invocation: Invocation
) -> ProbeResult:
    """func(invocation), in a thread of its own, waited for `seconds`; one still running
    then is inconclusive, and left to finish unwatched: its answer is dropped, and
    logged, so that whoever set the probe's timeout sees it is too short."""
    slots = _python_slots
    if not slots.acquire(blocking=False):
        detail = f"not started: {PYTHON_PROBES_AT_ONCE} python probes still run in this process"
        # Each of them outlived its wait: hung, most likely, until the process ends.
        log.error(
            "python probe %s invocation=%s; restarting the worker frees their threads",
            detail, invocation.invocation_id or "-",
        )  # fmt: skip
        return ProbeResult(Finding.INCONCLUSIVE, detail=detail)
    answers: list[Any] = []
    given_up: list[bool] = []  # by the waiter; decided under `deciding`, with `answers`
    deciding = threading.Lock()
    started = time.monotonic()

    def answer() -> None:
        try:
            found = func(invocation)
        except Exception as exc:  # a probe bug is inconclusive, as run() makes it
            found = ProbeResult(Finding.INCONCLUSIVE, detail=f"probe raised {type(exc).__name__}")
        finally:
            connections.close_all()  # this thread's, which nothing else would close
            slots.release()
        with deciding:
            answers.append(found)
            late = bool(given_up)
        if late:
            log.warning(
                "python probe answered after its wait invocation=%s waited=%gs took=%.1fs "
                "finding=%s",
                invocation.invocation_id or "-", seconds, time.monotonic() - started,
                getattr(found, "finding", "?"),
            )  # fmt: skip

    thread = threading.Thread(target=answer, name="python-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    with deciding:
        if not answers:
            given_up.append(True)
            detail = f"no answer within {seconds:g} s; the probe runs on, unwatched"
            return ProbeResult(Finding.INCONCLUSIVE, detail=detail)
    return answers[0]  # type: ignore[no-any-return]


def run(
    config: Mapping[str, Any], invocation: Invocation, *, python_wait: float | None = None
) -> ProbeResult | None:
    """The probe's answer; None when the capability has no probe (a person decides). A
    python probe is waited for at most `python_wait` seconds when given (a person at
    the console waits less than a worker)."""
    kind = config.get("kind", "none")
    if kind == "none":
        return None
    if kind not in ("http", "python"):
        raise ProbeConfigError(f"unknown probe kind {kind!r}")
    started = time.perf_counter()
    try:
        if kind == "http":
            result = http_probe(config, invocation)
        else:
            result = python_probe(config, invocation, wait=python_wait)
    except ProbeConfigError:
        raise
    except Exception as exc:  # a probe bug must not crash-loop the worker
        result = ProbeResult(Finding.INCONCLUSIVE, detail=f"probe raised {type(exc).__name__}")
    if not isinstance(result, ProbeResult):  # nor may a python probe's wrong answer
        detail = f"probe returned {type(result).__name__}, not a ProbeResult"
        result = ProbeResult(Finding.INCONCLUSIVE, detail=detail)
    reference = result.business_reference
    if not isinstance(reference, str) or len(reference) > REFERENCE_LENGTH:
        detail = f"probe returned a reference that is not text of at most {REFERENCE_LENGTH}"
        result = ProbeResult(Finding.INCONCLUSIVE, detail=detail)
    duration = int((time.perf_counter() - started) * 1000)
    return replace(result, duration_ms=duration, retry_after=_bounded(result.retry_after))
