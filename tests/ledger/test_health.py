from __future__ import annotations

from django.test import Client, override_settings


def test_healthz_answers_without_touching_dependencies(client: Client) -> None:
    response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_readyz_checks_the_database_and_the_real_broker(db: None, client: Client) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"] == {"database": "ok", "broker": "ok"}


@override_settings(CELERY_BROKER_URL="redis://127.0.0.1:9/0")
def test_readyz_reports_a_broker_that_does_not_answer(db: None, client: Client) -> None:
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["broker"] != "ok"
