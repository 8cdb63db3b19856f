"""The one rule for names the audit trail carries: invocation, task and attempt ids
(the API) and runtime names (every event names its runtime as actor)."""

# In Python `$` also matches before a final newline; `(?!\n)` refuses that, and the
# pattern stays valid ECMAScript for the OpenAPI schema.
# No "/": ids travel in URL paths (an id holding one could not be sent an outcome).
IDENTIFIER_REGEX = r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]*(?!\n)$"
IDENTIFIER_HINT = "Use letters, digits and . _ : @ + = - only, starting with a letter or digit."
