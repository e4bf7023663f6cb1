"""The admin API's parts that need no gateway process: the spend query, its CSV, body validation, the audit log
without a file, and the OpenAPI document (validated by openapi-spec-validator, and checked against the routes the
admin app really serves)."""

from __future__ import annotations

import csv
import io
import json
import logging
from datetime import UTC, date, datetime

import pytest
from openapi_spec_validator import validate
from starlette.datastructures import QueryParams
from starlette.routing import Route

from gateway.admin.app import build_admin_app
from gateway.admin.audit import AUDIT_LOGGER, Actor, AuditLog
from gateway.admin.bodies import validated
from gateway.admin.openapi import openapi_document
from gateway.admin.spend import SpendQuery, parse_spend_query, spend_csv
from gateway.app import Gateway
from gateway.config import ConfigError, load_config
from gateway.errors import GatewayError
from gateway.keystore.records import KeySettings
from gateway.observability.log_format import JsonLineFormatter


def seconds(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


def query(text: str, accept: str = "") -> SpendQuery:
    return parse_spend_query(QueryParams(text), accept, today=date(2026, 12, 3))


def refused(text: str) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        query(text)
    assert caught.value.status == 400
    return caught.value


def test_the_default_window_is_the_current_calendar_month():
    assert (query("").start, query("").end) == (seconds("2026-12-01"), seconds("2027-01-01"))
    january = parse_spend_query(QueryParams(""), today=date(2027, 1, 31))
    assert (january.start, january.end) == (seconds("2027-01-01"), seconds("2027-02-01"))


def test_times_as_dates_datetimes_and_unix_seconds():
    days = query("start=2026-11-01&end=2026-11-30")
    assert (days.start, days.end) == (seconds("2026-11-01"), seconds("2026-12-01"))  # a date `end` is the whole day
    moments = query("start=2026-11-01T10:30:00&end=2026-11-01T14:00:00%2B02:00")  # naive is UTC; an offset converts
    assert (moments.start, moments.end) == (seconds("2026-11-01T10:30:00"), seconds("2026-11-01T12:00:00"))
    zulu = query("start=1700000000&end=2023-11-15T00:00:00Z")
    assert (zulu.start, zulu.end) == (1_700_000_000, seconds("2023-11-15"))


def test_bad_times_and_windows_are_400s_naming_the_parameter():
    assert refused("start=yesterday").param == "start"
    assert refused("end=2026-13-01").param == "end"
    assert refused("start=" + "9" * 40).param == "start"
    assert refused("start=2026-12-02&end=2026-12-01").param == "end"
    assert refused("start=2020-01-01&end=2026-01-01").param == "end"  # over the window bound


def test_group_by_takes_commas_and_repeats_and_refuses_unknown_groups():
    assert query("group_by=key,model&group_by=day&group_by=key").group_by == ("key", "model", "day")
    assert query("group_by=tenant").columns()[0] == "tenant"
    assert "'group_by'" in refused("group_by=key,colour").message
    assert refused("group_by=day,month").param == "group_by"


def test_filters_and_format_are_checked():
    parsed = query("tenant=acme&key=abcdef123456")
    assert (parsed.tenant, parsed.key_id, parsed.csv) == ("acme", "abcdef123456", False)
    assert refused("key=ABC").param == "key"
    assert refused("tenant=" + "t" * 129).param == "tenant"
    assert refused("format=xml").param == "format"
    assert refused("from=2026-01-01").param == "from"
    assert query("format=csv").csv and query("", accept="text/csv, */*;q=0.1").csv
    assert not query("format=json", accept="text/csv").csv


def test_csv_has_the_groups_asked_for_then_totals_and_defuses_formulas():
    parsed = query("group_by=model,key,day")
    rows = [
        {
            "key_id": "abcdef123456",
            "model": '=HYPERLINK("http://x")',
            "period": "2026-12-01",
            "tenant": "not asked for",
            "requests": 3,
            "prompt_tokens": 120,
            "cached_tokens": 64,
            "completion_tokens": 30,
            "cost": 0.000012345,
            "cost_nanos": 12345,
            "currency": "USD",
        }
    ]
    header, line = list(csv.reader(io.StringIO(spend_csv(parsed, rows))))
    assert header[:3] == ["model", "key_id", "period"] and "tenant" not in header
    cells = dict(zip(header, line, strict=True))
    assert cells["model"].startswith("'=")
    assert (
        cells["cost"] == "0.000012345"
        and cells["cost_nanos"] == "12345"
        and cells["requests"] == "3"
        and cells["currency"] == "USD"
    )


def test_a_refused_body_names_the_field_without_echoing_it():
    with pytest.raises(GatewayError) as caught:
        validated(KeySettings, {"tenant": "acme", "limits": {"rpm": 0}})
    assert caught.value.status == 400 and caught.value.param == "limits.rpm" and "limits.rpm" in caught.value.message
    long_key = "k" * 5000
    with pytest.raises(GatewayError) as caught:
        validated(KeySettings, {"tenant": "acme", long_key: 1})
    assert len(caught.value.message) < 300 and caught.value.param is not None


@pytest.fixture(scope="module")
def admin_routes() -> list[tuple[str, str]]:
    app = build_admin_app(Gateway(load_config(None)), token="unit-test-token")
    return [
        (route.path, method.lower())
        for route in app.routes  # type: ignore[attr-defined]
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    ]


def test_the_openapi_document_is_valid_and_describes_every_admin_route(admin_routes):
    document = openapi_document()
    validate(document)
    served = set(admin_routes)
    described = {
        (path, method) for path, item in document["paths"].items() for method in item if method != "parameters"
    }
    assert served == described
    assert document["components"]["securitySchemes"]["adminToken"]["scheme"] == "bearer"
    view = document["components"]["schemas"]["KeyView"]["properties"]
    assert "digest" not in view and "previous_digest" not in view and "revoked_at" in view


def test_audit_lines_go_to_the_audit_logger_without_a_file(caplog):
    actor = Actor("admin-token", "10.0.0.1", "bob")
    with caplog.at_level(logging.INFO, logger=AUDIT_LOGGER):
        AuditLog(None).record("revoke", actor, "abcdef123456", "acme", {"revoked_at": None}, {"revoked_at": 1.0}, "r1")
    (record,) = [r for r in caplog.records if r.name == AUDIT_LOGGER]
    line = json.loads(JsonLineFormatter().format(record))
    assert (line["action"], line["actor"]["name"], line["after"]) == ("revoke", "bob", {"revoked_at": 1.0})


def test_an_audit_file_that_cannot_be_written_stops_start_up(tmp_path):
    with pytest.raises(ConfigError, match="admin.audit_log"):
        AuditLog(tmp_path / "no-such-directory" / "audit.jsonl")
