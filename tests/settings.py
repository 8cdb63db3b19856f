"""Test settings: the project's settings, pointed at the machine's PostgreSQL and Redis
unless DATABASE_URL / CELERY_BROKER_URL say otherwise."""

import os
import sys

from psycopg.conninfo import conninfo_to_dict

os.environ.setdefault("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/ledger")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DATABASE_POOL_TIMEOUT", "2")
# Queues of their own per test database: two suites on one machine, or the pytest-xdist
# workers of one (each on a database of its own), share Redis, and a worker of one must
# not take (and drop) another's tasks. A process running tests names them (pytest-xdist's
# controller passes its environment to the workers it starts, so each worker names them
# again); the processes the tests start inherit the name.
if "pytest" in sys.modules:
    queue = f"ledger-tests-{conninfo_to_dict(os.environ['DATABASE_URL'])['dbname']}"
    if xdist_worker := os.environ.get("PYTEST_XDIST_WORKER"):
        queue += f"-{xdist_worker}"
    os.environ["LEDGER_QUEUE"] = queue

from ledger.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
