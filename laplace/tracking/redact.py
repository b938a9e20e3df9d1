"""Secrets never reach MLflow: `redact` masks the value of every environment variable whose
name says it is a secret (TOKEN, KEY, SECRET, PASSWORD, PASSWD, CREDENTIAL) and the password
of any URL (`https://user:***@host`)."""

from __future__ import annotations

import os
import re

# An environment variable whose name matches this holds a secret: its value is never logged.
SECRET_ENV_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Shorter values ("1", "true", "false": TOKENIZERS_PARALLELISM=false) are flags, not secrets,
# and masking them would mangle every param that happens to contain them.
MIN_SECRET_CHARS = 8
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^/@:\s]*):(?P<password>[^/@\s]+)@", re.IGNORECASE)
REDACTED = "***"


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """Values of the environment variables named like secrets, longest first."""
    env = os.environ if environ is None else environ
    found = {v for k, v in env.items() if SECRET_ENV_NAME.search(k) and len(v.strip()) >= MIN_SECRET_CHARS}
    return sorted(found, key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """`text` with every secret environment value and every URL password replaced by ***."""
    text = str(text)
    for secret in secret_values() if secrets is None else secrets:
        text = text.replace(secret, REDACTED)
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}:{REDACTED}@", text)
