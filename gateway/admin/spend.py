"""The spend report: `GET /admin/spend`, grouped by key, tenant, model and period, as JSON or CSV.

Times are UTC. `start` and `end` take Unix seconds, an ISO-8601 datetime (without an offset: UTC) or a date; the
window is [start, end), except that an `end` given as a date covers that whole day, so `start=2026-12-01&
end=2026-12-31` is all of December. Without them, the report is the current calendar month's.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Literal, get_args

from pydantic import BaseModel, Field
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import invalid_request
from gateway.spend.store import GroupBy, amount_text
from gateway.tenancy.tenant_name import tenant_param

if TYPE_CHECKING:
    from gateway.app import Gateway

QUERY_PARAMS = ("group_by", "start", "end", "tenant", "key", "format")
GROUPS: tuple[GroupBy, ...] = get_args(GroupBy)
PERIODS = ("hour", "day", "month")
MAX_WINDOW = timedelta(days=731)
MAX_TIME_CHARS = 64
_KEY_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


class SpendRow(BaseModel):
    """One line of the report: the fields of the groups asked for, then the totals."""

    key_id: str | None = Field(default=None, description="group 'key': the key's id; '' for requests without one")
    tenant: str | None = Field(default=None, description="group 'tenant'")
    model: str | None = Field(default=None, description="group 'model'")
    period: str | None = Field(
        default=None, description="group 'hour', 'day' or 'month': its start as an ISO date (and hour), UTC"
    )
    requests: int = Field(description="requests served: an upstream answered them")
    refused_requests: int = Field(
        description="requests not served: refused by the gateway (a limit, the budget, the guard) or failed upstream"
    )
    prompt_tokens: int = Field(description="prompt tokens not served from a prefix cache")
    cached_tokens: int
    completion_tokens: int
    cost: float = Field(description="in the price table's currency")
    cost_nanos: int = Field(description="the cost exactly, in 1e-9 of the currency: the sum of each request's cost")
    currency: str
    cache_hits: int = Field(description="requests the response cache answered: no upstream asked, not in `requests`")
    cache_hit_tokens: int = Field(
        description="their prompt and completion tokens, not in the token counts above; priced at the `cached` price"
    )


TOTALS = [name for name in SpendRow.model_fields if name not in ("key_id", "tenant", "model", "period")]


class SpendReport(BaseModel):
    object: Literal["list"] = "list"
    start: str = Field(description="the window's start, ISO-8601 UTC")
    end: str = Field(description="the window's end (excluded), ISO-8601 UTC")
    group_by: list[GroupBy]
    data: list[SpendRow]


@dataclass(frozen=True, slots=True)
class SpendQuery:
    start: int  # Unix seconds
    end: int
    group_by: tuple[GroupBy, ...]
    tenant: str | None
    key_id: str | None
    csv: bool

    def columns(self) -> list[str]:
        """The report's columns: one per group asked for, in that order, then the totals."""
        groups = ["period" if group in PERIODS else "key_id" if group == "key" else group for group in self.group_by]
        return [*groups, *TOTALS]


def parse_spend_query(params: QueryParams, accept: str = "", today: date | None = None) -> SpendQuery:
    """The report's query, or a 400 naming the parameter that is wrong."""
    unknown = sorted(set(params) - set(QUERY_PARAMS))
    if unknown:
        raise invalid_request(
            f"unknown query parameter '{unknown[0][:64]}' (known: {', '.join(QUERY_PARAMS)})", param=unknown[0][:64]
        )
    group_by = _group_by(params.getlist("group_by"))
    month = (today or datetime.now(UTC).date()).replace(day=1)
    start = _time(params["start"], "start", end=False) if "start" in params else _midnight(month)
    end = _time(params["end"], "end", end=True) if "end" in params else _midnight(_next_month(month))
    if end <= start:
        raise invalid_request("'end' must be after 'start'", param="end")
    if end - start > MAX_WINDOW:
        raise invalid_request(f"the report covers at most {MAX_WINDOW.days} days", param="end")
    tenant = tenant_param(params.get("tenant"))
    key_id = params.get("key")
    if key_id is not None and not (len(key_id) == 12 and _KEY_ID_CHARS.issuperset(key_id)):
        raise invalid_request("'key' must be a key id: 12 lowercase letters and digits", param="key")
    form = params.get("format")
    if form not in (None, "json", "csv"):
        raise invalid_request("'format' must be 'json' or 'csv'", param="format")
    wants_csv = form == "csv" or (form is None and "text/csv" in accept)
    return SpendQuery(int(start.timestamp()), int(end.timestamp()), group_by, tenant, key_id, wants_csv)


def spend_csv(query: SpendQuery, rows: Sequence[dict]) -> str:
    """The report as CSV; a text cell a spreadsheet would run as a formula (`=...`) is quoted with a `'`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    columns = query.columns()
    writer.writerow(columns)
    for row in rows:
        writer.writerow(
            amount_text(row["cost_nanos"]) if column == "cost" else _cell(row.get(column)) for column in columns
        )
    return out.getvalue()


def spend_route(gateway: Gateway) -> Callable[[Request], Awaitable[Response]]:
    async def spend(request: Request) -> Response:
        query = parse_spend_query(request.query_params, request.headers.get("accept", ""))
        rows = await gateway.spend.report(query.start, query.end, query.group_by, query.tenant, query.key_id)
        if query.csv:
            return Response(spend_csv(query, rows), media_type="text/csv; charset=utf-8")
        window = {"start": _iso(query.start), "end": _iso(query.end)}
        return JSONResponse({"object": "list", **window, "group_by": list(query.group_by), "data": rows})

    return spend


def _group_by(values: list[str]) -> tuple[GroupBy, ...]:
    groups: list[GroupBy] = []
    for name in (part.strip() for value in values for part in value.split(",")):
        if name not in GROUPS:
            raise invalid_request(
                f"'group_by' takes {', '.join(GROUPS)}, not '{name[:64]}'", param="group_by", code="invalid_value"
            )
        if name not in groups:
            groups.append(name)  # type: ignore[arg-type]  # checked against GroupBy's values above
    if sum(group in PERIODS for group in groups) > 1:
        raise invalid_request("'group_by' takes one of hour, day and month", param="group_by", code="invalid_value")
    return tuple(groups)


def _time(text: str, param: str, end: bool) -> datetime:
    """Unix seconds, an ISO datetime (UTC unless it says otherwise) or an ISO date (its midnight; for `end`, the
    next one)."""
    problem = f"'{param}' must be Unix seconds, an ISO-8601 date or datetime"
    if len(text) > MAX_TIME_CHARS:
        raise invalid_request(problem, param=param)
    try:
        if text.isascii() and text.isdigit():
            return datetime.fromtimestamp(int(text), UTC)
        if len(text) == 10:
            day = date.fromisoformat(text)
            return _midnight(day + timedelta(days=1) if end else day)
        moment = datetime.fromisoformat(text)
        # inside the try: an offset can move a datetime at either end of the calendar out of it (OverflowError)
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (ValueError, OverflowError, OSError):
        raise invalid_request(problem, param=param) from None


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def _next_month(first: date) -> date:
    return first.replace(year=first.year + 1, month=1) if first.month == 12 else first.replace(month=first.month + 1)


def _iso(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _cell(value: object) -> object:
    if isinstance(value, str) and value.startswith(_FORMULA_STARTS):
        return "'" + value
    return "" if value is None else value
