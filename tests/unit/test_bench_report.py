"""portcullis bench's terminal table: one column per run, and each run's errors listed under it."""

from __future__ import annotations

from gateway.bench.metrics import RequestResult, summarize
from gateway.bench.report import format_table


def _run(results: list[RequestResult]) -> dict:
    """A run's result as the runner writes it: the summary plus its plan and prefix-cache figures."""
    return {
        **summarize(results, duration_s=1.0),
        "plan": {"num_requests": len(results), "sent": len(results)},
        "prefix_cache": {"measured_hit_rate": None, "oracle_hit_rate": 0.5},
    }


def _done(index: int) -> RequestResult:
    return RequestResult(index, 0, index, 0, success=True, status=200, ttft_s=0.1, e2el_s=0.3, completion_tokens=3)


def _failed(index: int, error: str) -> RequestResult:
    return RequestResult(index, 0, index, 0, status=500, error=error)


def test_each_run_is_a_column_and_only_failing_runs_list_errors() -> None:
    clean = _run([_done(0), _done(1)])
    failing = _run([_done(0), _failed(1, "HTTP 500: boom"), _failed(2, "HTTP 500: boom"), _failed(3, "timeout")])
    lines = format_table({"clean": clean, "failing": failing}).splitlines()
    assert lines[0].split() == ["clean", "failing"]
    assert [line.split()[-2:] for line in lines if line.startswith("Failed")] == [["0", "3"]]
    assert [line for line in lines if "errors:" in line] == ["[failing] errors: 2x HTTP 500: boom; 1x timeout"]
    assert "Prefix cache hit rate (oracle)" in "\n".join(lines)
