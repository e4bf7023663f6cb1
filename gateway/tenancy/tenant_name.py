"""What a tenant's name may be: 1 to 128 characters, none of them a control character (C0, DEL or C1).

A tenant's name is written wherever its requests are counted and told: the spend ledger (in Redis each row is a key
id, a tenant and a model joined by U+001F), rate-limit and budget keys, access logs, audit lines and metrics labels.
A control character is a separator or a line break in those, so a name holding one could break every tenant's spend
report or pass for another row or line. It is held where a name is given: a key's settings (the admin API, `portcullis
keys`), a static key in portcullis.yaml (`auth.keys[].tenant`), and the admin API's `tenant` query parameters.
Letters of any script, spaces and punctuation (`acme:prod`, `Société Générale`) stay names.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from gateway.errors import invalid_request

MAX_TENANT_CHARS = 128
_CONTROL = "\\x00-\\x1f\\x7f-\\x9f"
TENANT_NAME_PATTERN = rf"^[^{_CONTROL}]{{1,{MAX_TENANT_CHARS}}}$"
TenantName = Annotated[str, Field(pattern=TENANT_NAME_PATTERN, description="1 to 128 characters, no control character")]
_TENANT_NAME = re.compile(TENANT_NAME_PATTERN)


def tenant_param(value: str | None) -> str | None:
    """A `tenant` query parameter: None, or a tenant's name; a 400 naming `tenant` for anything else."""
    if value is not None and not _TENANT_NAME.fullmatch(value):  # fullmatch: `$` would pass a final line break
        raise invalid_request(
            f"'tenant' must be 1 to {MAX_TENANT_CHARS} characters, none of them a control character", param="tenant"
        )
    return value
