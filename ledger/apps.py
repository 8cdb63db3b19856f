from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "ledger"
    verbose_name = "Invocation Ledger"

    def ready(self) -> None:
        # The project's Celery app, configured from these settings, must exist in every
        # process Django starts, the web's too. Without it a task sent from there (the
        # console's "Re-run probe now") goes through Celery's default app: to its
        # default broker and queue, where no worker of the ledger reads.
        from ledger import celery  # noqa: F401
