"""Celery tasks: thin, take ids, call services. Correctness never depends on a
message: every sweep finds again whatever is due, so a lost or duplicated message
only delays or repeats a compare-and-set that happens once."""

from __future__ import annotations

import logging
import os
import socket
import threading

from celery import shared_task

from ledger.models import Capability, Invocation
from ledger.services import LedgerError
from reconciliation import probes, services, sweeper

log = logging.getLogger(__name__)


def worker_name() -> str:
    """Who holds a claim: the machine and process, and the thread when a worker runs its
    jobs in threads (the embedded broker's default pool), so that a job whose lease
    was taken over by another thread of its process cannot record its answer as if it
    still held the claim."""
    name = f"{socket.gethostname()}:{os.getpid()}"
    if threading.current_thread() is not threading.main_thread():
        name += f"/{threading.get_native_id()}"
    return name


@shared_task(acks_late=True, ignore_result=True)
def sweep_overdue_attempts() -> int:
    """Beat runs this every LEDGER_SWEEP_INTERVAL_SECONDS."""
    flagged = sweeper.sweep()
    sweeper.release_lost_claims()
    sweeper.expire_leases()
    sweeper.send_due_probes(reconcile_invocation.delay)
    return flagged


@shared_task(acks_late=True, ignore_result=True)
def reconcile_invocation(invocation_id: str, force: bool = False) -> str:
    """Claim, probe (read-only), record. Returns what happened, for logs and tests."""
    with services.probe_lock(invocation_id):
        return _reconcile(invocation_id, worker_name(), force)


def _reconcile(invocation_id: str, worker: str, force: bool) -> str:
    try:
        invocation = services.invocation_claim(
            invocation_id=invocation_id, worker=worker, force=force
        )
    except LedgerError as error:
        log.error("probe refused invocation=%s error=%s: %s", invocation_id, error.type, error)
        return f"refused: {error.type}"
    if invocation is None:
        return "not claimed"
    # The claim loaded the invocation with its capability: no further query, but for
    # one recorded undeclared.
    capability = invocation.probed_by()
    config = capability.probe if capability else {}
    try:
        result = probes.run(config, invocation)
    except probes.ProbeConfigError as exc:
        log.warning("probe misconfigured invocation=%s error=%s", invocation_id, exc)
        result = probes.ProbeResult(probes.Finding.INCONCLUSIVE, detail=f"misconfigured: {exc}")
    settled = services.record_probe_result(
        invocation_id=invocation_id, worker=worker, result=result
    )
    finding = result.finding if result is not None else "no_probe"
    if settled is None:
        log.info("probe invocation=%s finding=%s lease_lost", invocation_id, finding)
        return "lease lost"
    log.info("probe invocation=%s finding=%s status=%s", invocation_id, finding, settled.status)
    return "recorded"


# Invocations a run of request_probes records (in one statement pair, through
# ledger.services.invocation_transitions) before it queues the next run.
REQUEST_BATCH = 200


@shared_task(acks_late=True, ignore_result=True)
def request_probes(scope: str, actor: str, after: int = 0) -> int:
    """An operator's "re-run the probes" for a capability, after its probe was added or
    the business system it asks is back: each escalated invocation the probe could
    settle gets the operator's probe_requested event, then a job that claims it.

    A batch a run, each run queuing the next: a worker is held for a batch at a time,
    the probes of one batch run while the next is recorded, and a worker lost mid-way
    leaves one batch to deliver again, not the whole capability. A batch delivered
    twice asks again only for those escalated again meanwhile: probes are read-only, so
    that repeats a question, never an effect."""
    capability = Capability.objects.filter(scope=scope).first()
    if capability is None or not capability.has_probe:
        log.warning("probes not requested capability=%s: it has no probe", scope)
        return 0
    batch = list(
        Invocation.objects.awaiting_probe_of(capability)
        .filter(pk__gt=after)
        .order_by("pk")
        .values_list("pk", "invocation_id")[:REQUEST_BATCH]
    )
    requested = services.probes_requested(
        capability=capability,
        invocation_ids=[invocation_id for _, invocation_id in batch],
        actor=actor,
    )
    for invocation_id in requested:
        reconcile_invocation.delay(invocation_id, force=True)
    if len(batch) == REQUEST_BATCH:
        request_probes.delay(scope, actor, after=batch[-1][0])
    log.info(
        "probes requested capability=%s invocations=%d after=%d more=%s actor=%s",
        scope, len(requested), after, len(batch) == REQUEST_BATCH, actor,
    )  # fmt: skip
    return len(requested)
