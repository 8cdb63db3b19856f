"""The Invocation Ledger client for agent runtimes (httpx only; no Django)."""

from ledger.client.runtime import (
    AsyncLedgerClient,
    BusinessFailure,
    CallContext,
    DispatchNotEstablished,
    InvocationResult,
    LedgerClient,
    LedgerRequestError,
    LedgerUnreachable,
    NotDispatched,
)
from ledger.client.spool import FlushReport, Spool

__all__ = [
    "AsyncLedgerClient",
    "BusinessFailure",
    "CallContext",
    "DispatchNotEstablished",
    "FlushReport",
    "InvocationResult",
    "LedgerClient",
    "LedgerRequestError",
    "LedgerUnreachable",
    "NotDispatched",
    "Spool",
]
