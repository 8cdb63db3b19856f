from __future__ import annotations

import logging
import logging.config
import os
from typing import Any

from celery import Celery, Task
from celery.signals import celeryd_init, setup_logging

from ledger.db.errors import connection_lost

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ledger.settings")

log = logging.getLogger(__name__)


class LedgerTask(Task):
    """A task that meets PostgreSQL down, restarting or killed logs one line and ends:
    nothing rests on a task's message (the sweep finds again whatever is due, beat
    sends the periodic tasks again), and Celery's own report, an error with two
    tracebacks for every task that ran during the outage, told an operator nothing
    more than /readyz and the database's own log."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:
            if not connection_lost(exc):
                raise
            log.warning("task not done task=%s database unreachable: %s", self.name, exc)
            return None


app = Celery("ledger", task_cls=LedgerTask)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@celeryd_init.connect
@setup_logging.connect
def log_as_the_web_does(**kwargs: object) -> None:
    """Worker and beat log through settings.LOGGING (its format, LOG_LEVEL) instead of
    Celery's own setup, so one parser reads every process's lines, the seal hashes
    that anchor the chain outside the database among them. A setup_logging receiver
    is what tells Celery to leave logging alone (its --loglevel no longer applies);
    celeryd_init comes earlier, before the worker warns that it runs as root, so that
    warning is a record of `py.warnings` too."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    logging.captureWarnings(True)
