"""The database backend: Django's PostgreSQL backend, lending no dropped connection."""
