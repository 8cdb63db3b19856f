"""Settings, all from the environment; see .env.example for every variable.

With no DATABASE_URL and no CELERY_BROKER_URL the ledger runs on embedded defaults:
the PostgreSQL that `python -m ledger.run` starts under .data/pg (from the pgserver
wheel) and Kombu's filesystem broker under .data/broker.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP
from kombu import Queue
from psycopg.conninfo import conninfo_to_dict

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("LEDGER_DATA_DIR", BASE_DIR / ".data"))
EMBEDDED_PG_DIR = DATA_DIR / "pg"
EMBEDDED_BROKER_DIR = DATA_DIR / "broker"


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if raw.lower() in {"1", "true", "yes", "on"}:
        return True
    if raw.lower() in {"0", "false", "no", "off", ""}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), not {raw!r}")


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    """An integer of at least `minimum`: a zero slice or interval would do nothing, or
    spin, without a word."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, not {raw!r}") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {value}")
    return value


def env_rate(name: str, default: str) -> str:
    """A request rate as DRF writes them: 600/min, 10/s, 50000/hour."""
    raw = os.environ.get(name, default)
    if re.fullmatch(r"[1-9][0-9]*/(s|sec|second|m|min|minute|h|hour|d|day)", raw) is None:
        raise ImproperlyConfigured(f"{name} must be a rate such as 600/min, not {raw!r}")
    return raw


def env_named(prefix: str) -> dict[str, str]:
    """Settings given by name in the environment: LEDGER_PROBE_SECRET_PAYMENTS=… is
    env_named("LEDGER_PROBE_SECRET_")["PAYMENTS"]."""
    return {
        name.removeprefix(prefix): value
        for name, value in os.environ.items()
        if name.startswith(prefix) and name != prefix and value
    }


def data_dir_secret_key(path: Path) -> str:
    """The key of every process sharing this data directory when SECRET_KEY is unset:
    made at random by the first, kept in `path` (mode 0600) for the others and for
    the next start. A key in the code would be everyone's: anyone could sign sessions.

    The key is written whole to a file of its own, then linked into place, which
    fails if another process got there first: all read the winner's key.
    """
    try:
        return path.read_text() if path.exists() else _make_secret_key(path)
    except OSError as error:
        raise ImproperlyConfigured(
            f"SECRET_KEY is not set and no key can be kept in {path} ({error}); set SECRET_KEY"
        ) from None


def _make_secret_key(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_urlsafe(50))
    try:
        os.link(mine, path)
    except FileExistsError:
        pass
    finally:
        mine.unlink()
    return path.read_text()


DEBUG = env_bool("DEBUG", False)
# A deployment of more than one host sets SECRET_KEY; a single host may leave it to
# the data directory.
SECRET_KEY = os.environ.get("SECRET_KEY") or data_dir_secret_key(DATA_DIR / "secret_key")

ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django.contrib.postgres",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "ledger",
    "reconciliation",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "ledger.middleware.DatabaseUnavailableMiddleware",
]

# The console loads nothing from elsewhere and runs no inline script without a nonce.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF, CSP.NONCE],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "frame-ancestors": [CSP.NONE],
    "form-action": [CSP.SELF],
}
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "console:queue"
LOGOUT_REDIRECT_URL = "login"
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False  # htmx reads the token from the page, not the cookie

# Served over HTTPS only (a deployment; the embedded defaults serve plain HTTP on
# 127.0.0.1): cookies are never sent in clear and plain HTTP is redirected, except
# the probes a load balancer or Prometheus sends to the process itself.
LEDGER_HTTPS = env_bool("LEDGER_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = LEDGER_HTTPS
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
# Off unless asked for: a browser that has seen it refuses plain HTTP for that long.
SECURE_HSTS_SECONDS = env_int("LEDGER_HSTS_SECONDS", 0)
# Only behind a proxy that terminates TLS and sets X-Forwarded-Proto itself, dropping
# whatever a client sent: otherwise any client could claim its request was secure.
if env_bool("LEDGER_PROXY_SETS_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

ROOT_URLCONF = "ledger.urls"
WSGI_APPLICATION = "ledger.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "django.template.context_processors.csp",
            ],
        },
    },
]


def database_from_url(url: str) -> dict[str, object]:
    try:
        params = conninfo_to_dict(url)
    except Exception as exc:
        raise ImproperlyConfigured(f"DATABASE_URL is not a PostgreSQL URL: {exc}") from None
    if not params.get("dbname"):
        raise ImproperlyConfigured("DATABASE_URL must name a database, e.g. .../ledger")
    # psycopg prepares only the statements that ask for it: the evidence statements
    # (ledger/store.py), whose plans hold at every table size (migration 0016), once
    # per connection, as planning them on each request cost more than running them.
    # Automatically prepared ORM queries kept a generic plan made while their table
    # was small, and a generic plan cannot use a partial index whose predicate a
    # parameter decides (the sweeper's). psycopg ignores prepare=True without a
    # threshold, hence one that is never reached. Set DATABASE_PREPARED_STATEMENTS=false
    # behind a transaction-mode pooler such as PgBouncer, which cannot keep them.
    options: dict[str, object] = {
        "server_side_binding": True,
        "prepare_threshold": 2**31 - 1 if env_bool("DATABASE_PREPARED_STATEMENTS", True) else None,
        # JIT pays off for long analytic queries; the ledger's are short, and on a
        # 1,000-item batch's read it spent 22 ms compiling a 30 ms query.
        "options": "-c jit=off",
    }
    if env_bool("DATABASE_POOL", True):
        options["pool"] = {
            "min_size": env_int("DATABASE_POOL_MIN", 2),
            "max_size": env_int("DATABASE_POOL_MAX", 16, minimum=1),
            # How long a request waits for a connection before answering 503.
            "timeout": env_int("DATABASE_POOL_TIMEOUT", 5, minimum=1),
        }
    return {
        # Django's PostgreSQL backend, lending no pooled connection PostgreSQL dropped.
        "ENGINE": "ledger.db",
        "NAME": params["dbname"],
        "USER": params.get("user", ""),
        "PASSWORD": params.get("password", ""),
        "HOST": params.get("host", ""),
        "PORT": params.get("port", ""),
        "OPTIONS": options,
        "TEST": {"NAME": f"test_{params['dbname']}"},
    }


DATABASE_URL = os.environ.get(
    "DATABASE_URL", f"postgresql://postgres@/ledger?host={EMBEDDED_PG_DIR}"
)
DATABASES = {"default": database_from_url(DATABASE_URL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Without collectstatic (tests, a fresh checkout) serve from the finders.
WHITENOISE_USE_FINDERS = True

# Shared by every web and worker process (a table in the ledger's own database, made
# by migration 0015), so a login lockout holds whichever process answers. The
# per-token API throttle counts in each process's memory instead
# (ledger/api/throttling.py): a shared counter would cost the hot path two more
# statements per request, so LEDGER_THROTTLE_RATE applies per web process.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.db.DatabaseCache",
        "LOCATION": "ledger_cache",
    },
}

# The ingestion API answers only to runtime tokens: no sessions, no browsable HTML.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["ledger.api.authentication.RuntimeTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["ledger.api.parsers.StrictJSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "ledger.api.errors.exception_handler",
    "DEFAULT_THROTTLE_CLASSES": ["ledger.api.throttling.RuntimeTokenThrottle"],
    "DEFAULT_THROTTLE_RATES": {"runtime": env_rate("LEDGER_THROTTLE_RATE", "50000/min")},
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Invocation Ledger API",
    "DESCRIPTION": (
        "Write-ahead intents, attempt admission and outcomes for agent tool calls. "
        "Every response carries the typed state; errors are "
        '`{"error": {"type", "message", "details"}}`.'
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "COMPONENT_SPLIT_REQUEST": True,
    # Swagger UI from the installed sidecar package: the docs work offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The write bodies are msgspec structs; their schemas join the components here.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "ledger.api.inputs.add_schema_components",
    ],
    "ENUM_NAME_OVERRIDES": {
        "OutcomeKindEnum": "ledger.policy.OutcomeKind",
        "StatusEnum": "ledger.policy.Status",
    },
}

# Limits (each refused with a typed 400/413 that names the field).
LEDGER_MAX_BODY_BYTES = env_int("LEDGER_MAX_BODY_BYTES", 256 * 1024, minimum=1)
LEDGER_MAX_BATCH_BODY_BYTES = env_int("LEDGER_MAX_BATCH_BODY_BYTES", 16 * 1024 * 1024, minimum=1)
LEDGER_MAX_BATCH_ITEMS = 1000
LEDGER_MAX_JSON_DEPTH = env_int("LEDGER_MAX_JSON_DEPTH", 32, minimum=1)
# Django refuses bodies above this before the API sees them; the API's own limits
# are lower and typed.
DATA_UPLOAD_MAX_MEMORY_SIZE = LEDGER_MAX_BATCH_BODY_BYTES + 1024

# Deadlines: an attempt with no outcome after timeout_ms + grace is flagged.
LEDGER_DEFAULT_TIMEOUT_MS = env_int("LEDGER_DEFAULT_TIMEOUT_MS", 30_000, minimum=1)
LEDGER_DEFAULT_GRACE_MS = env_int("LEDGER_DEFAULT_GRACE_MS", 60_000)
LEDGER_DEFAULT_MAX_ATTEMPTS = env_int("LEDGER_DEFAULT_MAX_ATTEMPTS", 5, minimum=1)

# Celery: a real broker always. Embedded default is Kombu's filesystem transport,
# which delivers between processes on one machine with nothing to install (the host
# is named only so that Kombu does not warn, at every start, that none was).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://localhost//")
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith("filesystem://"):
    # Kombu's, with messages that a worker never finds half-written (ledger/broker.py).
    CELERY_BROKER_TRANSPORT = "ledger.broker:Transport"
    _queue_dir = str(EMBEDDED_BROKER_DIR / "queue")
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": _queue_dir,
        "data_folder_out": _queue_dir,
        "control_folder": str(EMBEDDED_BROKER_DIR / "control"),
        # What each worker has taken and not acknowledged, put back if it is killed.
        "held_folder": str(EMBEDDED_BROKER_DIR / "held"),
        # How long a worker with no free process waits before it looks again (Kombu's
        # default, 1 s, held the embedded ledger to about two jobs a second).
        "polling_interval": 0.1,
    }
    # A worker started by hand runs its jobs in threads: on a broker without an event
    # loop, prefork's processes take their jobs through one pipe behind one lock, which
    # one of them killed alone leaves held, and the worker runs no job again
    # (ledger/run.py starts workers of one process each).
    CELERY_WORKER_POOL = "threads"
# Probe jobs have a queue of their own: in a business system's outage each waits out
# its timeouts, and queued behind them the sweep, the sealer and the verification would
# wait for every one. `make run` keeps a worker off it (ledger/run.py).
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("LEDGER_QUEUE", "celery")
LEDGER_PROBE_QUEUE = f"{CELERY_TASK_DEFAULT_QUEUE}.probes"
CELERY_TASK_QUEUES = (Queue(CELERY_TASK_DEFAULT_QUEUE), Queue(LEDGER_PROBE_QUEUE))
# The anchoring waits on a store outside the ledger too (up to 15 s when it hangs), so
# it goes with the probes, whose workers expect to wait, rather than delay a sweep.
CELERY_TASK_ROUTES = {
    "reconciliation.tasks.reconcile_invocation": {"queue": LEDGER_PROBE_QUEUE},
    "ledger.tasks.anchor_hashes": {"queue": LEDGER_PROBE_QUEUE},
}
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")
# The longest a periodic task catches up in one run: a sweep of a backlog of overdue
# attempts, seals of a busy hour's events, the watches behind them. The next run goes
# on. A worker sends RabbitMQ no heartbeat while it runs a task: a sweep of 94,726
# overdue attempts ran 3.5 minutes, RabbitMQ closed the connection at its 60 s
# heartbeat timeout, and the task's acknowledgement failed.
LEDGER_CATCH_UP_SECONDS = 20.0
# Reconciliation: probe leases, retries with exponential backoff, then a person.
LEDGER_SWEEP_INTERVAL_SECONDS = env_int("LEDGER_SWEEP_INTERVAL_SECONDS", 5, minimum=1)
LEDGER_PROBE_LEASE_SECONDS = env_int("LEDGER_PROBE_LEASE_SECONDS", 60, minimum=1)
LEDGER_PROBE_MAX_TRIES = env_int("LEDGER_PROBE_MAX_TRIES", 5, minimum=1)
LEDGER_PROBE_BACKOFF_SECONDS = env_int("LEDGER_PROBE_BACKOFF_SECONDS", 5)
# Probe header secrets, by name: LEDGER_PROBE_SECRET_PAYMENTS=… → {secret:PAYMENTS}.
LEDGER_PROBE_SECRETS = env_named("LEDGER_PROBE_SECRET_")
# CA certificates (PEM) every https probe trusts besides certifi's bundle: the company's
# own CA, for business systems whose certificates it signs.
LEDGER_PROBE_CA_FILE = os.environ.get("LEDGER_PROBE_CA_FILE", "")
# A PEM file of the certificate (and its key) probes show business systems that ask
# for one: mutual TLS.
LEDGER_PROBE_CLIENT_CERT = os.environ.get("LEDGER_PROBE_CLIENT_CERT", "")
# The same for the probes whose configuration names them ("tls": "PAYMENTS"), since
# each business system may have a CA and give the ledger a certificate of its own:
# LEDGER_PROBE_CA_FILE_PAYMENTS (trusted besides the above), and
# LEDGER_PROBE_CLIENT_CERT_PAYMENTS (shown instead of the above).
LEDGER_PROBE_CA_FILES = env_named("LEDGER_PROBE_CA_FILE_")
LEDGER_PROBE_CLIENT_CERTS = env_named("LEDGER_PROBE_CLIENT_CERT_")
# Python probes that may be named in a capability's probe configuration.
LEDGER_PYTHON_PROBES = [p for p in os.environ.get("LEDGER_PYTHON_PROBES", "").split(",") if p]
LEDGER_SEAL_INTERVAL_SECONDS = env_int("LEDGER_SEAL_INTERVAL_SECONDS", 60, minimum=1)
# Background verification: every interval, the running pass checks slices of this many
# more invocations (every event of each) and the seals that follow, one transaction
# each, until it has spent LEDGER_VERIFY_SECONDS (0: one slice) or finished; a pass
# covers the whole ledger as it was when it started, then the next one starts. The
# time, not a count, bounds the worker's and the database's share: 3 s a minute is a
# pass over a million one-event invocations in about half an hour, an hour and a half
# where every chain holds four events, rather than eight hours or more at one slice a
# minute.
LEDGER_VERIFY_INTERVAL_SECONDS = env_int("LEDGER_VERIFY_INTERVAL_SECONDS", 60, minimum=1)
LEDGER_VERIFY_SLICE = env_int("LEDGER_VERIFY_SLICE", 2000, minimum=1)
LEDGER_VERIFY_SECONDS = env_int("LEDGER_VERIFY_SECONDS", 3)
# The rate-limit watch reads what the sealer numbered since its last run, so it sees
# an admission up to one seal interval plus one of its own after it was made.
LEDGER_RATE_WATCH_INTERVAL_SECONDS = env_int("LEDGER_RATE_WATCH_INTERVAL_SECONDS", 60, minimum=1)
# The reference watch reads the same way: an invocation whose business reference a
# later one names too is flagged up to one seal interval plus one of its own after.
LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS = env_int(
    "LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS", 60, minimum=1
)
# The event table's month partitions are made months ahead; hourly is plenty, and a
# run that waited too long on a lock (5 s at most) is tried again the next hour.
LEDGER_PARTITION_INTERVAL_SECONDS = env_int("LEDGER_PARTITION_INTERVAL_SECONDS", 3600, minimum=1)
# The console's Verify page checks at most this many events in one request (about 20 s
# at the ~10,000 events/s measured); `manage.py verify_ledger` has no limit.
LEDGER_VERIFY_PAGE_MAX_EVENTS = env_int("LEDGER_VERIFY_PAGE_MAX_EVENTS", 200_000, minimum=1)
# Where beat sends the newest seal's hash and the action log's (ledger.anchors): a
# store the database's administrators cannot rewrite. Empty: they are only logged.
LEDGER_ANCHOR_URL = os.environ.get("LEDGER_ANCHOR_URL", "")
if LEDGER_ANCHOR_URL and not LEDGER_ANCHOR_URL.startswith(("https://", "http://")):
    raise ImproperlyConfigured(
        f"LEDGER_ANCHOR_URL must be an http(s) URL, not {LEDGER_ANCHOR_URL!r}"
    )
LEDGER_ANCHOR_TOKEN = os.environ.get("LEDGER_ANCHOR_TOKEN", "")  # sent as a bearer token
# CA certificates (PEM) an https store is trusted by besides certifi's bundle.
LEDGER_ANCHOR_CA_FILE = os.environ.get("LEDGER_ANCHOR_CA_FILE", "")
LEDGER_ANCHOR_INTERVAL_SECONDS = env_int("LEDGER_ANCHOR_INTERVAL_SECONDS", 300, minimum=1)
# How the hashes are sent: "json" (a POST of them, to a store that keeps them) or
# "rfc3161" (to a time-stamping authority, which signs their digest with the time: the
# ledger keeps its token and checks it against LEDGER_ANCHOR_TSA_ROOTS, a PEM file of
# the authority's root certificates).
LEDGER_ANCHOR_PROTOCOL = os.environ.get("LEDGER_ANCHOR_PROTOCOL", "json")
LEDGER_ANCHOR_TSA_ROOTS = os.environ.get("LEDGER_ANCHOR_TSA_ROOTS", "")
if LEDGER_ANCHOR_PROTOCOL not in ("json", "rfc3161"):
    raise ImproperlyConfigured(
        f"LEDGER_ANCHOR_PROTOCOL must be json or rfc3161, not {LEDGER_ANCHOR_PROTOCOL!r}"
    )
if LEDGER_ANCHOR_PROTOCOL == "rfc3161" and not LEDGER_ANCHOR_TSA_ROOTS:
    raise ImproperlyConfigured(
        "LEDGER_ANCHOR_PROTOCOL rfc3161 needs LEDGER_ANCHOR_TSA_ROOTS: the PEM file of the "
        "time-stamping authority's root certificates its tokens are checked against"
    )
# Empty: /metrics is open, like /healthz (aggregate counts, no ids or subjects).
LEDGER_METRICS_TOKEN = os.environ.get("LEDGER_METRICS_TOKEN", "")
CELERY_BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "seal-new-events": {
        "task": "ledger.tasks.seal_new_events",
        "schedule": float(LEDGER_SEAL_INTERVAL_SECONDS),
    },
    "verify-next-slice": {
        "task": "ledger.tasks.verify_next_slice_of_the_ledger",
        "schedule": float(LEDGER_VERIFY_INTERVAL_SECONDS),
        "options": {"expires": float(LEDGER_VERIFY_INTERVAL_SECONDS)},
    },
    "watch-rate-limits": {
        "task": "ledger.tasks.watch_declared_rate_limits",
        "schedule": float(LEDGER_RATE_WATCH_INTERVAL_SECONDS),
        "options": {"expires": float(LEDGER_RATE_WATCH_INTERVAL_SECONDS)},
    },
    "watch-shared-references": {
        "task": "ledger.tasks.watch_shared_references",
        "schedule": float(LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS),
        "options": {"expires": float(LEDGER_REFERENCE_WATCH_INTERVAL_SECONDS)},
    },
    "create-event-partitions": {
        "task": "ledger.tasks.create_event_partitions",
        "schedule": float(LEDGER_PARTITION_INTERVAL_SECONDS),
        "options": {"expires": float(LEDGER_PARTITION_INTERVAL_SECONDS)},
    },
    "anchor-hashes": {
        "task": "ledger.tasks.anchor_hashes",
        "schedule": float(LEDGER_ANCHOR_INTERVAL_SECONDS),
        "options": {"expires": float(LEDGER_ANCHOR_INTERVAL_SECONDS)},
    },
    "sweep-overdue-attempts": {
        "task": "reconciliation.tasks.sweep_overdue_attempts",
        "schedule": float(LEDGER_SWEEP_INTERVAL_SECONDS),
        # A sweep that waited longer than its interval is superseded by the next one.
        "options": {"expires": float(LEDGER_SWEEP_INTERVAL_SECONDS)},
    },
}

LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO")
# Every process's records, gunicorn's own included (ledger/gunicorn_conf.py).
LOG_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"structured": {"format": LOG_FORMAT}},
    # The level is the handler's as well as the root's: a record from a named logger
    # ("django.request" logs every 404 as a warning) reaches the root's handlers
    # without passing the root's own level.
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "structured",
            "level": LOG_LEVEL,
        },
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        # One line per probe request is noise; the probe_run event records each one.
        "httpx": {"level": "WARNING"},
        # Django logs every 4xx as a warning: a runtime's refused request (a conflict,
        # a replayed mistake, a burst past the throttle) is answered with its typed
        # error, and the access log has its status. Failures of the ledger's own (5xx,
        # with their traceback) are still logged; django.security's warnings too.
        "django.request": {"level": "ERROR"},
        # Beat sends the sweep every few seconds: a line for each sending, receipt and
        # success would bury the lines that say something. The tasks log what they
        # did (sweep flagged=, sealed, probe), and a task that fails still logs an
        # error through celery.app.trace.
        "celery.beat": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
        "celery.app.trace": {"level": "WARNING"},
    },
}
