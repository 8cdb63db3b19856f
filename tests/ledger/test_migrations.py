"""The migrations build the schema the models describe."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_every_model_change_has_its_migration() -> None:
    """A model's index or constraint changed without a migration would exist in no
    database, and the tests, which build theirs from the migrations, would not notice."""
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out)
    except SystemExit:  # what --check does when a migration is missing
        pytest.fail(f"the models changed with no migration:\n{out.getvalue()}")
