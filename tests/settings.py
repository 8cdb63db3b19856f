"""Test settings: the project's settings, pointed at the machine's PostgreSQL and Redis
unless DATABASE_URL / CELERY_BROKER_URL say otherwise."""

import os

os.environ.setdefault("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/ledger")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DATABASE_POOL_TIMEOUT", "2")

from ledger.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
