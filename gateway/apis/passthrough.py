"""A pool's opt-in passthrough routes (`passthrough: ["/v1/files*", "/v1/audio/*"]`): what the gateway does not
read as a model request. The request line, headers and body are the WAF's (all of it application fields: there is
no prompt), auth and request-rate limits apply; the content stages (tokens, admission, guard) do not, and the body
and answer travel as they are."""

from __future__ import annotations

from typing import Any

from gateway.apis.carriers import PASSTHROUGH
from gateway.apis.shape import Api, CountForm


class Passthrough(Api):
    name = "passthrough"
    path = ""  # any path a pool opts in to
    operation = "passthrough"
    output_fields = ()
    fill_field = None
    carriers = PASSTHROUGH

    def check(self, payload: dict[str, Any]) -> None:
        return None  # the upstream's to judge

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        return "prompt", ""


def matches(pattern: str, path: str) -> bool:
    """A pool's passthrough pattern: a path, or a prefix ending in '*'."""
    return path.startswith(pattern[:-1]) if pattern.endswith("*") else path == pattern
