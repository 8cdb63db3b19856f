from __future__ import annotations

from django import forms


class CapabilityImportForm(forms.Form):
    document = forms.FileField(
        help_text="An OpenAPI 3 document (YAML or JSON) with x-agent-capability on operations."
    )
    dry_run = forms.BooleanField(required=False, help_text="Show what would change; write nothing.")
