"""Operator journeys in real headless Chromium (Debian's package, driven by
Playwright), with JavaScript and without it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from axe_playwright_python.sync_playwright import Axe
from django.contrib.auth.models import Group, User
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright

from ledger.capabilities import capability_settings_change
from ledger.integrity import verify_next_slice
from ledger.models import Capability, Invocation
from ledger.rate_limits import watch_rate_limits
from ledger.services import flag_missing_evidence
from reconciliation.tasks import reconcile_invocation
from tests.conftest import Api, registered
from tests.ledger.test_bundle import verify as verify_bundle

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Playwright's sync API runs an event loop in this thread; the ORM calls made by
    # the test itself around it are ordinary synchronous ones.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


def user(name: str, *groups: str) -> None:
    created = User.objects.create_user(name, password="correct horse")
    for group in groups:
        created.groups.add(Group.objects.get_or_create(name=group)[0])


@pytest.fixture
def flagged(api: Api, refund: Capability) -> None:
    for n, risk in ((1, "medium"), (2, "high")):
        Capability.objects.filter(pk=refund.pk).update(risk_level=risk)
        api.intent(invocation_id=f"inv-{n}", idempotency_key=f"k-{n}", attempt_id="a1")
        deadline = Invocation.objects.get(invocation_id=f"inv-{n}").deadline_at
        assert deadline is not None
        flag_missing_evidence(invocation_id=f"inv-{n}", now=deadline)


def log_in(
    browser: Browser, base: str, name: str, javascript: bool, errors: list[str] | None = None
) -> Page:
    """A logged-in page; with `errors`, every error the browser logs goes there."""
    page = browser.new_context(java_script_enabled=javascript).new_page()
    if errors is not None:

        def note_errors(message: ConsoleMessage) -> None:
            if message.type == "error":
                errors.append(f"{message.text} ({message.location.get('url')})")

        page.on("console", note_errors)
    page.goto(f"{base}/accounts/login/")
    page.fill("#id_username", name)
    page.fill("#id_password", "correct horse")
    page.click("button[type=submit]")
    expect(page.locator("h1")).to_have_text("Reconciliation queue")
    return page


def resolve_as_present(page: Page, url: str, reference: str) -> None:
    page.goto(url)
    page.check("input[value=effect_present]")
    page.fill("#id_business_reference", reference)
    page.fill("#id_note", f"Refund {reference} is in the payments console.")
    page.click("form.resolve button[type=submit]")


@pytest.mark.parametrize("javascript", [True, False], ids=["js", "no-js"])
def test_an_operator_filters_opens_resolves_and_the_item_leaves_the_queue(
    browser: Browser, live_server: Any, flagged: None, javascript: bool
) -> None:
    user("olga", "operator")
    page = log_in(browser, live_server.url, "olga", javascript)
    expect(page.locator("#queue-rows")).to_contain_text("inv-1")
    page.select_option("select[name=risk]", "medium")
    if not javascript:
        page.click("form.filters button[type=submit]")
    expect(page).to_have_url(re.compile(r"risk=medium"))
    expect(page.locator("#queue-rows")).not_to_contain_text("inv-2")
    page.click("text=inv-1")
    expect(page.locator(".timeline li").first).to_contain_text("chain verified")
    page.check("input[value=effect_absent]")
    page.fill(
        "#id_note",
        "No refund in the payments console for this key, nor in the day's settlement file "
        "that the payments team sent this morning.",
    )
    page.click("form.resolve button[type=submit]")
    expect(page.locator("dd.status")).to_have_text("retry_allowed")
    expect(page.locator("main")).to_contain_text("Resolved: retry_allowed.")
    # However long the note, the chain's status stays on its entry's first line, inside it.
    entry = page.locator(".timeline li").last
    box, status = entry.bounding_box(), entry.locator(".chain").bounding_box()
    assert box is not None and status is not None
    assert box["y"] < status["y"] < box["y"] + 20 < box["y"] + box["height"]
    page.click("text=Queue")
    expect(page.locator("#queue-rows")).not_to_contain_text("inv-1")
    assert Invocation.objects.get(invocation_id="inv-1").status == "retry_allowed"


@pytest.mark.parametrize("javascript", [True, False], ids=["js", "no-js"])
def test_an_operator_pages_through_the_queue_and_back(
    browser: Browser,
    live_server: Any,
    flagged: None,
    javascript: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from reconciliation import views

    monkeypatch.setattr(views, "QUEUE_PAGE", 1)  # the live server runs in this process
    user("olga", "operator")
    page = log_in(browser, live_server.url, "olga", javascript)
    rows = page.locator("#queue-rows tbody tr")
    expect(rows).to_have_count(1)
    expect(rows).to_contain_text("inv-2")  # high risk first
    if javascript:
        page.evaluate("window.sameDocument = true")
    page.click("text=Next page")
    expect(page).to_have_url(re.compile(r"after=\d+-\d+-\d+"))
    expect(rows).to_contain_text("inv-1")
    expect(page.locator("#queue-rows")).not_to_contain_text("Next page")
    page.click("text=First page")
    expect(rows).to_contain_text("inv-2")
    expect(page).not_to_have_url(re.compile("after="))
    # With JavaScript htmx swapped the rows in place; without it each was a page load.
    assert page.evaluate("window.sameDocument === true") is javascript


def propose_as_olga(browser: Browser, base: str, javascript: bool) -> Page:
    """Olga (an operator) proposes RF-4471 for high-risk inv-2; Abe may approve."""
    user("olga", "operator")
    user("abe", "approver")
    page = log_in(browser, base, "olga", javascript)
    resolve_as_present(page, f"{base}/invocations/inv-2/", "RF-4471")
    expect(page.locator("dd.status")).to_have_text("resolution_proposed")
    return page


@pytest.mark.parametrize("javascript", [True, False], ids=["js", "no-js"])
def test_a_high_risk_resolution_is_proposed_by_one_and_approved_by_another(
    browser: Browser, live_server: Any, flagged: None, javascript: bool
) -> None:
    page = propose_as_olga(browser, live_server.url, javascript)
    expect(page.locator(".proposal")).not_to_contain_text("Approve")  # not for the proposer
    approver = log_in(browser, live_server.url, "abe", javascript)
    approver.goto(f"{live_server.url}/invocations/inv-2/")
    approver.click(".proposal button[type=submit]")
    expect(approver.locator("dd.status")).to_have_text("succeeded")
    events = Invocation.objects.get(invocation_id="inv-2").events
    approved = events.get(kind="resolution_approved").data
    assert (approved["proposed_by"], approved["approved_by"]) == ("user:olga", "user:abe")


@pytest.mark.parametrize("javascript", [True, False], ids=["js", "no-js"])
def test_a_reference_another_invocation_names_is_resolved_only_once_confirmed(
    browser: Browser, live_server: Any, flagged: None, api: Api, javascript: bool
) -> None:
    api.intent(invocation_id="inv-3", idempotency_key="k-3", attempt_id="a1")
    api.outcome("inv-3", "a1", kind="succeeded", business_reference="RF-4471")
    user("olga", "operator")
    page = log_in(browser, live_server.url, "olga", javascript)
    resolve_as_present(page, f"{live_server.url}/invocations/inv-1/", "RF-4471")

    expect(page.locator("form.resolve")).to_contain_text("RF-4471 is already named by inv-3.")
    expect(page.locator("dd.status")).to_have_text("reconciliation_required")
    # What the person typed is still there; only the confirmation is new.
    expect(page.locator("#id_note")).to_have_value("Refund RF-4471 is in the payments console.")
    page.check("input[name=same_reference_confirmed]")
    page.click("form.resolve button[type=submit]")

    expect(page.locator("dd.status")).to_have_text("succeeded")
    expect(page.locator("ul.references")).to_contain_text("Also named by 1 other invocation")
    resolution = Invocation.objects.get(invocation_id="inv-1").events.get(kind="resolution")
    assert resolution.data["also_named_by"] == ["inv-3"]


@pytest.mark.parametrize("javascript", [True, False], ids=["js", "no-js"])
def test_an_approver_confirms_a_reference_named_elsewhere_since_the_proposal(
    browser: Browser, live_server: Any, flagged: None, api: Api, javascript: bool
) -> None:
    propose_as_olga(browser, live_server.url, javascript)
    api.intent(invocation_id="inv-3", idempotency_key="k-3", attempt_id="a1")
    api.outcome("inv-3", "a1", kind="succeeded", business_reference="RF-4471")

    approver = log_in(browser, live_server.url, "abe", javascript)
    approver.goto(f"{live_server.url}/invocations/inv-2/")
    approver.fill(".proposal textarea[name=note]", "Checked with payments.")
    approver.click(".proposal button[type=submit]")

    expect(approver.locator(".proposal")).to_contain_text("RF-4471 is already named by inv-3.")
    expect(approver.locator("dd.status")).to_have_text("resolution_proposed")
    expect(approver.locator(".proposal textarea[name=note]")).to_have_value(
        "Checked with payments."
    )
    approver.check(".proposal input[name=same_reference_confirmed]")
    approver.click(".proposal button[type=submit]")

    expect(approver.locator("dd.status")).to_have_text("succeeded")
    approved = (
        Invocation.objects.get(invocation_id="inv-2").events.get(kind="resolution_approved").data
    )
    assert (approved["approval_note"], approved["also_named_by"]) == (
        "Checked with payments.",
        ["inv-3"],
    )


@pytest.mark.parametrize("javascript", [True, False], ids=["js", "no-js"])
def test_an_admin_restores_a_row_changed_outside_the_ledger(
    browser: Browser, live_server: Any, flagged: None, javascript: bool
) -> None:
    Invocation.objects.filter(invocation_id="inv-1").update(status="retry_allowed", cause="")
    user("ada", "admin")
    admin = log_in(browser, live_server.url, "ada", javascript)
    admin.goto(f"{live_server.url}/invocations/inv-1/")
    broken = admin.locator(".broken-record")
    expect(broken).to_contain_text("no longer agrees with its events (cause, status)")
    if javascript:  # axe runs as the page's script
        assert accessibility_problems(admin) == []

    admin.fill(".broken-record textarea[name=reason]", "INC-9: edited by hand")
    admin.click(".broken-record button[type=submit]")

    expect(admin.locator(".message.success")).to_have_text(
        "Restored from its events: cause, status."
    )
    expect(broken).to_have_count(0)
    expect(admin.locator("dd.status")).to_have_text("reconciliation_required")
    restoring = Invocation.objects.get(invocation_id="inv-1").events.get(kind="projection_restored")
    assert (restoring.actor, restoring.data["reason"]) == ("user:ada", "INC-9: edited by hand")


def test_a_reviewer_downloads_an_invocations_evidence_bundle_and_it_verifies(
    browser: Browser, live_server: Any, flagged: None, tmp_path: Path
) -> None:
    user("cora", "compliance")
    page = log_in(browser, live_server.url, "cora", javascript=True)
    page.goto(f"{live_server.url}/invocations/inv-1/")
    with page.expect_download() as downloading:
        page.click("text=Evidence bundle")
    download = downloading.value
    assert download.suggested_filename == "evidence-inv-1.zip"
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    result = verify_bundle(saved)
    assert result.returncode == 0, result.stdout + result.stderr
    events = Invocation.objects.get(invocation_id="inv-1").events.count()
    assert result.stdout.startswith(f"OK: {events} events and 0 seals verified")


def test_no_page_logs_an_error_in_the_browser(
    browser: Browser, live_server: Any, flagged: None
) -> None:
    """Nothing the pages, htmx or the API docs do is refused by their
    Content-Security-Policy, and nothing they load is missing (the favicon included)."""
    user("ada", "admin")
    errors: list[str] = []
    page = log_in(browser, live_server.url, "ada", True, errors)
    for path in ("/", "/dashboard/", "/invocations/inv-2/", "/audit/", "/audit/actions/",
                 "/audit/verify/?run=1", "/audit/capabilities/",
                 "/audit/capabilities/refund.create/"):  # fmt: skip
        response = page.goto(f"{live_server.url}{path}")
        assert response is not None and response.status == 200, path
        page.wait_for_load_state("load")
        expect(page.locator("h1")).to_be_visible()
    page.goto(f"{live_server.url}/api/docs/")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("Invocation Ledger API")
    expect(page.locator(".opblock").first).to_be_visible()
    assert errors == []


def accessibility_problems(page: Page) -> list[str]:
    """What axe-core finds on the page as it stands, a line per rule and element, and
    a title that is not the page's name in plain text (what a tab or a screen reader
    announces first)."""
    page.wait_for_load_state("load")
    violations = Axe().run(page).response["violations"]
    found = [
        f"{v['impact']} {v['id']}: {node['target']}" for v in violations for node in v["nodes"]
    ]
    if not re.fullmatch(r"[^<>\n]+ · Invocation Ledger", page.title()):
        found.append(f"title {page.title()!r}")
    return found


def test_axe_finds_nothing_on_any_console_page_in_any_state(
    browser: Browser, live_server: Any, flagged: None, api: Api
) -> None:
    """axe-core, the engine behind Lighthouse's accessibility audit, checks each page
    in the states an operator meets it in: logged out and refused, a filter refused,
    a flagged invocation to resolve, a reference to confirm, a proposal to approve."""
    base = live_server.url
    found: dict[str, list[str]] = {}

    visitor = browser.new_context().new_page()
    visitor.goto(f"{base}/accounts/login/")
    found["login"] = accessibility_problems(visitor)
    visitor.fill("#id_username", "nobody")
    visitor.fill("#id_password", "wrong")
    visitor.click("button[type=submit]")
    expect(visitor.locator(".errorlist, .errornote, .error").first).to_be_visible()
    found["login refused"] = accessibility_problems(visitor)

    olga = propose_as_olga(browser, base, True)
    found["proposal, to its proposer"] = accessibility_problems(olga)
    api.intent(invocation_id="inv-3", idempotency_key="k-3", attempt_id="a1")
    api.outcome("inv-3", "a1", kind="succeeded", business_reference="RF-4471")
    olga.goto(f"{base}/invocations/inv-1/")
    found["flagged invocation"] = accessibility_problems(olga)
    resolve_as_present(olga, f"{base}/invocations/inv-1/", "RF-4471")
    expect(olga.locator("form.resolve")).to_contain_text(
        "RF-4471 is already named by inv-2, inv-3."
    )
    found["reference to confirm"] = accessibility_problems(olga)

    abe = log_in(browser, base, "abe", True)
    abe.goto(f"{base}/invocations/inv-2/")
    expect(abe.locator(".proposal button[type=submit]")).to_be_visible()
    found["proposal, to an approver"] = accessibility_problems(abe)
    # A row changed outside the ledger, found by a whole background pass: the dashboard
    # and the Verify page list it, beside a running pass.
    Invocation.objects.filter(invocation_id="inv-3").update(status="failed")
    assert verify_next_slice(invocations=100) is not None
    assert verify_next_slice(invocations=1) is not None
    for path in ("/", "/?older_than_minutes=soon", "/dashboard/", "/audit/",
                 "/audit/?capability=refund.create", "/audit/?since=yesterday",
                 "/audit/actions/", "/audit/verify/?run=1", "/invocations/inv-3/",
                 "/audit/capabilities/", "/audit/capabilities/refund.create/"):  # fmt: skip
        response = abe.goto(f"{base}{path}")
        assert response is not None and response.status == 200, path
        found[path] = accessibility_problems(abe)

    assert {state: lines for state, lines in found.items() if lines} == {}


def test_screenshots_of_the_console(
    browser: Browser, live_server: Any, flagged: None, tmp_path: Path
) -> None:
    """The pictures in docs/ come from here (LEDGER_SCREENSHOTS=docs to refresh them)."""
    user("olga", "operator")
    capability_settings_change(
        scope="refund.create",
        actor="user:ada",
        reason="INC-4120: payments asked for fewer retries",
        max_attempts=3,
    )
    registered("refund.create", risk_level="high", rate_limit={"count": 60, "window": "1m"})
    watch_rate_limits()
    reconcile_invocation.run("inv-1")  # no probe: escalated, on the dashboard's probe card
    folder = Path(os.environ.get("LEDGER_SCREENSHOTS", tmp_path))
    page = log_in(browser, live_server.url, "olga", True)
    page.set_viewport_size({"width": 1280, "height": 800})
    shots = {
        "queue.png": "/",
        "invocation.png": "/invocations/inv-2/",
        "dashboard.png": "/dashboard/",
        "audit.png": "/audit/?capability=refund.create",
        "capability.png": "/audit/capabilities/refund.create/",
    }
    for name, path in shots.items():
        page.goto(f"{live_server.url}{path}")
        page.screenshot(path=str(folder / name), full_page=True)
        assert (folder / name).stat().st_size > 10_000


@pytest.mark.parametrize("javascript", [True, False], ids=["js", "no-js"])
def test_an_operator_asks_a_probe_about_a_key_from_the_capability_page(
    browser: Browser, live_server: Any, refunds: Capability, javascript: bool
) -> None:
    user("olga", "operator")
    page = log_in(browser, live_server.url, "olga", javascript)
    page.goto(f"{live_server.url}/audit/capabilities/refund.create/")
    if javascript:
        page.evaluate("window.sameDocument = true")
    page.fill("#id_idempotency_key", "k-never-refunded")
    page.click("form.probe-try button[type=submit]")
    result = page.locator("#probe-try-result")
    expect(result).to_contain_text("effect_absent")
    expect(result).to_contain_text("refunds?idempotency_key=k-never-refunded")
    assert page.evaluate("window.sameDocument === true") is javascript
    if javascript:  # axe runs as the page's script
        assert accessibility_problems(page) == []
