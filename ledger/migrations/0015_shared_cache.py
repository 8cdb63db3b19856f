"""The table behind the shared cache (CACHES["default"]): login lockouts live there.

Made by Django's own createcachetable, here so that `migrate` is all any database
needs.
"""

from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.db import migrations


def create_cache_table(apps: Any, schema_editor: Any) -> None:
    call_command("createcachetable", database=schema_editor.connection.alias, verbosity=0)


def drop_cache_table(apps: Any, schema_editor: Any) -> None:
    table = schema_editor.quote_name(settings.CACHES["default"]["LOCATION"])
    schema_editor.execute(f"DROP TABLE IF EXISTS {table}")


class Migration(migrations.Migration):
    dependencies = [("ledger", "0014_audit_time_order")]

    operations = [migrations.RunPython(create_cache_table, drop_cache_table)]
