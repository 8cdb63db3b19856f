# Everything goes through uv with the committed lock; uv itself is installed with pip
# if this machine has none.
export UV_PYTHON_DOWNLOADS := never
UV_VERSION := 0.13.8
UV := $(shell command -v uv 2>/dev/null || echo python3 -m uv)

.PHONY: run test lint deps bench test-tools

deps:
	@$(UV) --version >/dev/null 2>&1 || python3 -m pip install --quiet "uv==$(UV_VERSION)"
	@$(UV) sync --frozen --quiet

## Run the ledger (web on http://127.0.0.1:8000, Celery worker and beat).
run: deps
	$(UV) run --frozen python -m ledger.run

## Lint, type-check and run the whole test suite against PostgreSQL and Redis.
## Two pytest-xdist workers, each on a test database and broker queues of its own: much
## of the suite's time is spent waiting on the processes it starts (gunicorn, Celery,
## `make run`), which a second worker fills. Tests are dealt out one by one, and a worker
## whose share runs out takes some of the other's (`worksteal`: a test takes from 0.01
## to 40 s). Not by file (`loadfile`): schemathesis gives its tests of one function one
## node id, and `loadfile` ran one of them for all.
test: deps lint test-tools
	$(UV) run --frozen pytest --numprocesses 2 --dist worksteal
	@# Then the workers' tests marked embedded_broker again, on the broker `make run` uses.
	CELERY_BROKER_URL=filesystem://localhost// LEDGER_DATA_DIR="$$(mktemp -d)" \
		$(UV) run --frozen pytest -m embedded_broker

# What the tests drive besides Python, from Debian when this machine has none of it:
# Chromium (the console's journeys), promtool from the prometheus package (the alerting
# rules; the server is installed, never started) and OpenSSL (a time-stamping authority,
# and an auditor's check of its tokens).
test-tools:
	@[ -x /usr/bin/chromium ] || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	@missing=""; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	[ -x /usr/bin/openssl ] || missing="$$missing openssl"; \
	[ -z "$$missing" ] || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends $$missing)

lint: deps
	$(UV) run --frozen ruff check .
	$(UV) run --frozen ruff format --check .
	$(UV) run --frozen mypy .

## The benchmark (not part of the test suite): see README.
bench: deps
	$(UV) run --frozen python manage.py bench
	$(UV) run --frozen python manage.py bench_audit
