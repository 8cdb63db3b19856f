"""Test settings: the project's settings, pointed at the machine's PostgreSQL and Redis
unless DATABASE_URL / CELERY_BROKER_URL say otherwise."""

import os

from psycopg.conninfo import conninfo_to_dict

os.environ.setdefault("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/ledger")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DATABASE_POOL_TIMEOUT", "2")


def _queue_name() -> str:
    """Queues of their own per test database: two suites on one machine share Redis,
    and a worker of one must not take (and drop) the other's tasks. Set in the
    environment, the name is inherited by the processes the tests start, whose
    DATABASE_URL names the test database instead.

    The same for pytest-xdist's workers, each on a test database of its own: each
    inherits the name from the process that started it and adds its own; the processes
    a worker starts inherit the name whole.
    """
    queue = os.environ.get("LEDGER_QUEUE") or (
        f"ledger-tests-{conninfo_to_dict(os.environ['DATABASE_URL'])['dbname']}"
    )
    xdist_worker = os.environ.get("PYTEST_XDIST_WORKER")
    if xdist_worker and not queue.endswith(f"-{xdist_worker}"):
        queue += f"-{xdist_worker}"
    return queue


os.environ["LEDGER_QUEUE"] = _queue_name()

# After the environment it reads.
from ledger.settings import *  # noqa: E402, F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
