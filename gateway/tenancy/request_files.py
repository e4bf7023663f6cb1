"""A file of requests the upstream makes later with the pool's key (a batch's input file, one JSON request a line):
each request's references (gateway/tenancy/references.py) must be the tenant's, as if it had sent them itself, or a
batch would continue another tenant's stored response, read its files or call its models.

The file is read back from the upstream when the batch is made, whoever uploaded it and however (in one request or
in an upload's parts): its content cannot change after. A line that could hold a reference (gateway/tenancy/
references.py `may_refer`) or a model but is not JSON the gateway reads refuses the batch, since the upstream may read
it; a file larger than the pool's `max_response_bytes` cannot be checked and refuses it too.
"""

from __future__ import annotations

import asyncio

import orjson

from gateway.errors import GatewayError, invalid_request
from gateway.tenancy.references import Reference, may_refer, model_reference, references

CONTENT_PATH = "/v1/files/{}/content"  # OpenAI's Files API: a file's bytes
_NAMES_MODEL = b'"model"'  # a request line naming the model it calls (an escape in the name is `may_refer`'s)


def content_path(file_id: str) -> str:
    return CONTENT_PATH.format(file_id)


async def requests_references(content: bytes, member: str) -> list[Reference]:
    """Every reference the file's requests make (param: `<member> line <n>: <where>`); read off the event loop."""
    return await asyncio.to_thread(_references, content, member)


def unreadable(member: str, why: str) -> GatewayError:
    """The file could not be read whole to be checked."""
    return invalid_request(
        f"the file '{member}' names could not be read to check the requests in it: {why}",
        param=member,
        code="request_file_unreadable",
    )


def _references(content: bytes, member: str) -> list[Reference]:
    found = []
    for number, line in enumerate(content.split(b"\n"), start=1):  # JSONL: lines end at LF alone
        if not (may_refer(line) or _NAMES_MODEL in line):
            continue
        try:
            request = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise invalid_request(
                f"line {number} of the file '{member}' names is not JSON the gateway can read: standard JSON, no "
                "NaN or Infinity",
                param=f"{member} line {number}",
                code="invalid_json",
            ) from None
        where = f"{member} line {number}: "
        found += model_reference(request.get("body") if isinstance(request, dict) else None, where + "body")
        found += [r._replace(param=where + r.param) for r in references(request)]
    return found
