"""A deployment's security settings (HTTPS, the secret key): the settings read from the
environment at start, so each case runs in a fresh interpreter with its own
environment."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What each request answered: status, Location, and whether the CSRF cookie is Secure.
# No request here touches the database.
REQUESTS = """
import json, django
django.setup()
from django.test import Client
answers = {}
for path, proto in (("/accounts/login/", None), ("/healthz", None), ("/accounts/login/", "https")):
    headers = {"X-Forwarded-Proto": proto} if proto else {}
    response = Client(HTTP_HOST="127.0.0.1").get(path, headers=headers)
    cookie = response.cookies.get("csrftoken")
    answers[f"{path} {proto}"] = [
        response.status_code, response.get("Location"), bool(cookie and cookie["secure"])
    ]
print(json.dumps(answers))
"""


def run(code: list[str], **environment: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "ledger.settings",
        "SECRET_KEY": secrets.token_urlsafe(50),
        **environment,
    }
    return subprocess.run(
        [sys.executable, *code], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )


def deploy_warnings(**environment: str) -> set[str]:
    checked = run(["manage.py", "check", "--deploy"], **environment)
    return set(re.findall(r"security\.W\d+", checked.stdout + checked.stderr))


def answers(**environment: str) -> dict[str, list[object]]:
    done = run(["-c", REQUESTS], **environment)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_behind_https_the_deploy_check_finds_no_clear_cookie_or_plain_http(
    tmp_path: Path,
) -> None:
    clear = {"security.W004", "security.W008", "security.W012", "security.W016"}
    plain = deploy_warnings(SECRET_KEY="", LEDGER_DATA_DIR=str(tmp_path))
    assert clear <= plain
    assert "security.W009" not in plain  # the key made for the data directory is strong
    https = deploy_warnings(LEDGER_HTTPS="true", LEDGER_HSTS_SECONDS="31536000")
    # Left to the deployment: whether HSTS covers subdomains and asks for preloading.
    assert https == {"security.W005", "security.W021"}


def test_by_default_plain_http_is_served_with_ordinary_cookies() -> None:
    assert answers()["/accounts/login/ None"] == [200, None, False]


def test_behind_https_plain_http_is_redirected_except_the_process_probes() -> None:
    found = answers(LEDGER_HTTPS="true")
    assert found["/accounts/login/ None"] == [301, "https://127.0.0.1/accounts/login/", False]
    assert found["/healthz None"][:2] == [200, None]
    # Not trusted unless the deployment says its proxy sets the header.
    assert found["/accounts/login/ https"][0] == 301


def test_behind_a_proxy_that_terminates_tls_its_header_is_trusted() -> None:
    found = answers(LEDGER_HTTPS="true", LEDGER_PROXY_SETS_X_FORWARDED_PROTO="true")
    assert found["/accounts/login/ https"] == [200, None, True]
    assert found["/accounts/login/ None"][0] == 301


PRINT_KEY = (
    "import django; django.setup(); from django.conf import settings; print(settings.SECRET_KEY)"
)


def test_without_a_secret_key_the_processes_of_one_data_directory_share_one_made_for_it(
    tmp_path: Path,
) -> None:
    """Never a key published with the code: four processes starting at once (web
    workers, worker, beat) agree on one random key, kept for the next start."""
    data = tmp_path / "data"
    env = {**os.environ, "SECRET_KEY": "", "LEDGER_DATA_DIR": str(data)}
    starting = [
        subprocess.Popen(
            [sys.executable, "-c", PRINT_KEY],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    keys = {process.communicate()[0] for process in starting}
    assert all(process.returncode == 0 for process in starting)
    [key] = keys
    assert len(key.strip()) >= 50 and "insecure" not in key
    assert (data / "secret_key").stat().st_mode & 0o777 == 0o600
    assert [path.name for path in data.iterdir()] == ["secret_key"]

    restarted = run(["-c", PRINT_KEY], SECRET_KEY="", LEDGER_DATA_DIR=str(data))
    assert restarted.stdout == key
    elsewhere = run(["-c", PRINT_KEY], SECRET_KEY="", LEDGER_DATA_DIR=str(tmp_path / "other"))
    assert elsewhere.returncode == 0 and elsewhere.stdout != key
    given = run(["-c", PRINT_KEY], SECRET_KEY="set-by-the-deployment", LEDGER_DATA_DIR=str(data))
    assert given.stdout == "set-by-the-deployment\n"


def test_without_a_secret_key_or_a_writable_data_directory_the_ledger_does_not_start(
    tmp_path: Path,
) -> None:
    occupied = tmp_path / "a-file"
    occupied.write_text("")
    refused = run(["-c", PRINT_KEY], SECRET_KEY="", LEDGER_DATA_DIR=str(occupied))
    assert refused.returncode == 1
    assert "SECRET_KEY is not set and no key can be kept in" in refused.stderr
