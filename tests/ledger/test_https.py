"""A deployment behind HTTPS: the settings read from the environment at start, so each
case runs in a fresh interpreter with its own environment."""

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


def test_behind_https_the_deploy_check_finds_no_clear_cookie_or_plain_http() -> None:
    clear = {"security.W004", "security.W008", "security.W012", "security.W016"}
    assert clear <= deploy_warnings()
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
