"""gunicorn's settings under `make run` (`--config python:ledger.gunicorn_conf`).

gunicorn configures its own loggers: here its lines (started, worker booted, worker
timed out) take the ledger's format on standard error like every other record, and
its access log, a line per request, goes to standard output in the same format with
the request's fields as key=value.
"""

from ledger.settings import DATA_DIR, LOG_FORMAT, LOG_LEVEL

# gunicorn's control socket (`gunicornc -s .data/gunicorn.ctl`) in the ledger's own data
# folder. gunicorn's default is one path for all of a user's gunicorns
# ($HOME/.gunicorn/gunicorn.ctl): a second ledger, or a benchmark, took it over from
# the first, and gunicornc then showed, or shut down, the wrong one.
control_socket = str(DATA_DIR / "gunicorn.ctl")

access_log_format = (
    'remote=%(h)s request="%(r)s" status=%(s)s bytes=%(B)s duration_ms=%(M)s agent="%(a)s"'
)


def _stream(name: str) -> dict[str, str]:
    return {"class": "logging.StreamHandler", "formatter": "structured", "stream": name}


# gunicorn lays this over its defaults key by key, so each key is given whole.
logconfig_dict = {
    "formatters": {"structured": {"format": LOG_FORMAT}},
    "handlers": {"stderr": _stream("ext://sys.stderr"), "stdout": _stream("ext://sys.stdout")},
    "root": {"handlers": ["stderr"], "level": LOG_LEVEL},
    "loggers": {
        "gunicorn.error": {"handlers": ["stderr"], "level": LOG_LEVEL, "propagate": False},
        "gunicorn.access": {"handlers": ["stdout"], "level": "INFO", "propagate": False},
    },
}
