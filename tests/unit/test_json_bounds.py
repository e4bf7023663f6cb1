"""The parse stage's decoder refuses an object that names a key twice, and nothing else: keys repeat across objects,
and strings hold colons, quotes and backslashes in every escaped form."""

from __future__ import annotations

import pytest

from gateway.config import LimitsConfig
from gateway.edge import json_bounds
from gateway.errors import GatewayError

LIMITS = LimitsConfig()


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": 1, "a": 2}',
        b'{"m": [{"role": "user", "content": "x", "content": "y"}]}',
        b'{"a": "x\\": y", "a": 1}',  # an escaped quote then a colon inside the first value
        b'{"a": "\\u003a", "a": 2}',  # a colon written as an escape
        b'{"a" : 1 , "b": {"c": {"d": 1, "d": 1}}}',
        b'[{"a": 1, "a": 1}]',
        b'{"a": "\\u003a", "k": 1, "k": 2}',  # as many colons decoded as sent: the escape's makes up the key's
        b"[" * 300 + b'{"a": 1, "a": 2}' + b"]" * 300,  # deeper than orjson encodes
    ],
)
def test_a_key_named_twice_in_one_object_is_refused(body: bytes) -> None:
    with pytest.raises(GatewayError) as refused:
        json_bounds.decode(body, LIMITS)
    assert refused.value.status == 400 and refused.value.code == "duplicate_json_key"


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": "x:y", "b": [{"c": 1}, {"c": 2}]}',
        b'{"a": "\\\\", "b": ":"}',  # an escaped backslash closes the string before the next quote
        b'{"a": "\\\\\\":", "b": 1}',  # an escaped backslash, then an escaped quote
        b'{"a:": "b:", "c": "::::"}',
        b'{"a": {}, "b": [], "c": [[{"d": "e"}]]}',
        b'"a:b"',
        b"[1, 2]",
        b"[" * 300 + b'{"a": 1}' + b"]" * 300,  # deeper than orjson encodes
    ],
)
def test_keys_repeated_across_objects_and_colons_in_strings_pass(body: bytes) -> None:
    assert json_bounds.decode(body, LIMITS) is not None
