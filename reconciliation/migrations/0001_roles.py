"""The console's roles, as groups (README: Console)."""

from django.db import migrations

ROLES = ("operator", "approver", "compliance", "admin")


def create(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    for name in ROLES:
        Group.objects.get_or_create(name=name)


class Migration(migrations.Migration):
    dependencies = [("auth", "0012_alter_user_first_name_max_length")]

    operations = [migrations.RunPython(create, migrations.RunPython.noop)]
