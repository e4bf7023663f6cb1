"""Header values: any text the gateway answers with in a header is a valid field value, one that Starlette can encode
and uvicorn writes; a value that already is one is left as it is, any other gives the text back when percent-decoded."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE

from gateway.errors import GatewayError
from gateway.header_values import header_value


@pytest.mark.parametrize(
    "text",
    [
        "gpt-4o-mini",
        "ft:gpt-4o-mini:org-x:suffix_1:AbC9",
        "meta-llama/Llama-3.1-8B-Instruct",
        '"rpm";q=60;w=60, "tpm";q=1000;w=60',  # a RateLimit-Policy: inner spaces are a field value's own
        "attachment; filename*=UTF-8''na%C3%AFve.txt",  # a passthrough answer's own encoding, not encoded again
        "50%",
        "",
    ],
)
def test_printable_ascii_is_written_as_it_is(text):
    assert header_value(text) == text


@pytest.mark.parametrize(
    ("text", "written"),
    [
        ("模型", "%E6%A8%A1%E5%9E%8B"),
        ("test\x00model", "test%00model"),
        ("test\x7fmodel", "test%7Fmodel"),
        ("caf\u00e9", "caf%C3%A9"),  # Latin-1 would encode it, as a byte no client reads as UTF-8
        ("a\r\nset-cookie: x", "a%0D%0Aset-cookie: x"),
        ("50%\x00", "50%25%00"),  # an encoded value's % too, so that decoding it gives the text back
        (" padded ", "%20padded%20"),  # a reader trims the edges' spaces
        ("\udcff", "%ED%B3%BF"),  # a lone surrogate: an undecodable byte of an upstream's header, as aiohttp reads it
    ],
)
def test_anything_else_is_percent_encoded(text, written):
    assert header_value(text) == written


@given(st.text())
def test_any_text_becomes_a_field_value_that_is_it_or_decodes_back_to_it(text):
    value = header_value(text)
    assert value.isascii() and value.isprintable() and value == value.strip(" ")
    assert not HEADER_VALUE_RE.search(value.encode())
    assert value == text or unquote(value, errors="surrogatepass") == text


def test_an_error_answer_renders_its_headers():
    """What a GatewayError carries in its headers (the model that served, an upstream's Retry-After) is answered."""
    error = GatewayError(502, "failed", headers={"x-portcullis-model": "模型\x00"})
    response = error.response()
    assert isinstance(response, Response) and response.headers["x-portcullis-model"] == "%E6%A8%A1%E5%9E%8B%00"
