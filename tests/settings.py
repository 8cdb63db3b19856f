"""Test settings: the project's settings, pointed at the machine's PostgreSQL and Redis
unless DATABASE_URL / CELERY_BROKER_URL say otherwise."""

import os

from psycopg.conninfo import conninfo_to_dict

os.environ.setdefault("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/ledger")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DATABASE_POOL_TIMEOUT", "2")
# Queues of their own per test database: two suites on one machine share Redis, and a
# worker of one must not take (and drop) the other's tasks. Set here, inherited by the
# workers the tests start, whose DATABASE_URL names the test database instead.
os.environ.setdefault(
    "LEDGER_QUEUE", f"ledger-tests-{conninfo_to_dict(os.environ['DATABASE_URL'])['dbname']}"
)

from ledger.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
