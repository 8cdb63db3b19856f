from __future__ import annotations

from typing import Any

from django import forms

from ledger.capabilities import SETTINGS, settings_changes, settings_of
from ledger.models import Capability, RuntimeToken


class CapabilityImportForm(forms.Form):
    document = forms.FileField(
        help_text="An OpenAPI 3 document (YAML or JSON) with x-agent-capability on operations."
    )
    dry_run = forms.BooleanField(required=False, help_text="Show what would change; write nothing.")


class CapabilitySettingsForm(forms.ModelForm):
    """The admin's change form: the ledger's settings, with the reason for a change,
    which the action log keeps beside it."""

    reason = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="Why the settings change; kept in the action log with the change.",
    )

    class Meta:
        model = Capability
        fields = SETTINGS

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        # Against the row (not changed_data, which trusts the initial values the
        # browser posts back): what the registry will record as changed.
        changed = settings_changes(settings_of(self.instance), cleaned)
        if changed and not cleaned.get("reason", "").strip():
            self.add_error(
                "reason",
                f"Say why {', '.join(sorted(changed))} change: the action log keeps the "
                "reason with the change.",
            )
        return cleaned


class TokenIssueForm(forms.Form):
    label = forms.CharField(
        required=False,
        max_length=RuntimeToken._meta.get_field("label").max_length,
        help_text="What the token is for (a deployment, a host); kept with it and in the "
        "action log.",
    )
