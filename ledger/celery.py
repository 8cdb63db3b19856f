from __future__ import annotations

import logging.config
import os

from celery import Celery
from celery.signals import celeryd_init, setup_logging

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ledger.settings")

app = Celery("ledger")
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
