"""`portcullis bench serve` as a subprocess against real fake upstreams: JSON, table, PNG, failures, --runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT

FAKE = json.dumps({"fake": {"chunks": 4, "delay": 0.005, "header_delay": 0.03}})


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "serve", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def upstreams(module_launcher):
    """Two upstreams for the module's benchmarks; a test counts what reached them as a difference."""
    return module_launcher.fake_upstream("a"), module_launcher.fake_upstream("b")


def stats(upstream) -> dict:
    return httpx.get(upstream.url + "/_stats").json()


def test_bench_serve_writes_json_table_and_ttft_plot(upstreams, tmp_path: Path):
    upstream = upstreams[0]
    before = stats(upstream)
    out, png = tmp_path / "out.json", tmp_path / "ttft.png"
    proc = bench(
        "--base-url",
        upstream.url,
        "--model",
        "test-model",
        "--workload",
        "shared-prefix",
        "--tenants",
        "3",
        "--system-prompt-len",
        "100",
        "--conversations",
        "4",
        "--turns",
        "3",
        "--num-requests",
        "14",
        "--concurrency",
        "4",
        "--output-len",
        "4",
        "--seed",
        "1",
        "--api-keys",
        "ka,kb",
        "--extra-body",
        FAKE,
        "--slo-ttft-ms",
        "10000",
        "--slo-tpot-ms",
        "10000",
        "--json",
        str(out),
        "--plot",
        str(png),
    )
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"]["run"]
    assert run["plan"]["num_requests"] == run["plan"]["sent"] == 14
    assert (run["completed"], run["failed"], run["cancelled"]) == (14, 0, 0)
    assert len(run["requests"]) == 14
    assert run["ttft_ms"]["p50"] >= 25 and run["ttft_ms"]["mean"] > 0  # header_delay 30 ms
    assert run["tpot_ms"]["mean"] > 0 and run["itl_ms"]["mean"] > 0 and run["e2el_ms"]["p99"] >= run["ttft_ms"]["p99"]
    assert run["total_output_tokens"] == 14 * 4 and run["output_throughput"] > 0
    assert run["goodput"]["good_requests"] == 14
    assert run["replica_share"] is None and run["prefix_cache"]["measured_hit_rate"] is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "TTFT p99 (ms)" in proc.stdout and "Replica share" in proc.stdout and "n/a" in proc.stdout
    seen = stats(upstream)
    assert seen["requests"] - before["requests"] == 14
    assert seen["completed_streams"] - before["completed_streams"] == 14
    last = seen["last_body"]
    assert last["stream"] is True and last["max_tokens"] == 4 and last["fake"]["chunks"] == 4
    assert seen["last_headers"]["authorization"] in ("Bearer ka", "Bearer kb")


def test_bench_serve_runs_the_same_sequence_against_each_target_and_counts_failures(
    upstreams, fake_upstream, tmp_path: Path
):
    good, bad = upstreams[0], fake_upstream("bad", fail_status=503)
    out = tmp_path / "runs.json"
    proc = bench(
        "--runs",
        f"good={good.url}",
        f"bad={bad.url}",
        "down=http://127.0.0.1:9",
        "--model",
        "m",
        "--workload",
        "random",
        "--num-requests",
        "6",
        "--input-len",
        "20",
        "--request-rate",
        "50",
        "--extra-body",
        FAKE,
        "--json",
        str(out),
        "--no-request-rows",
    )
    assert proc.returncode == 1, proc.stderr  # a target with no completed request fails the command
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["good", "bad", "down"]
    assert runs["down"]["failed"] == 6 and list(runs["down"]["errors"])[0].startswith("ConnectError")
    assert runs["good"]["completed"] == 6 and runs["bad"]["completed"] == 0 and runs["bad"]["failed"] == 6
    assert list(runs["bad"]["errors"]) == ["HTTP 503: bad forced failure"]
    assert runs["good"]["plan"]["fingerprint"] == runs["bad"]["plan"]["fingerprint"]
    assert "requests" not in runs["good"]
    assert "6x HTTP 503: bad forced failure" in proc.stdout


def test_bench_through_the_gateway_reports_the_replica_share(upstreams, gateway, tmp_path: Path):
    from tests.conftest import pool

    a, b = upstreams
    gw = gateway({"pools": [pool("main", a.url, b.url, routing="round_robin")], "telemetry": {"replica_header": True}})
    out = tmp_path / "gw.json"
    proc = bench(
        "--base-url",
        gw.url + "/v1",
        "--model",
        "test-model",
        "--workload",
        "random",
        "--num-requests",
        "8",
        "--input-len",
        "16",
        "--concurrency",
        "2",
        "--extra-body",
        FAKE,
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"]["run"]
    assert run["completed"] == 8
    assert run["replica_share"] == {a.url: {"requests": 4, "share": 0.5}, b.url: {"requests": 4, "share": 0.5}}
    assert f"Replica {a.url} share" in proc.stdout


def test_oracle_matches_a_real_engine_prefix_cache(processes, tmp_path: Path):
    """Against the bundled engine from a cold cache, one request at a time: the oracle tokenizes prompts exactly as
    the engine does, and the engine's measured hits equal the oracle that counts cached outputs too."""
    from tests.conftest import free_port, spawn

    port = free_port()
    engine = spawn(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "engine",
            "serve",
            "--port",
            str(port),
            "--threads",
            "1",
            "--kv-cache-bytes",
            "64M",
        ],
        port,
        tmp_path / "engine.log",
        ready_path="/health",
        timeout=300,
    )
    processes.append(engine)
    out = tmp_path / "engine.json"
    proc = bench(
        "--base-url",
        engine.url,
        "--workload",
        "shared-prefix",
        "--tenants",
        "2",
        "--system-prompt-len",
        "120",
        "--conversations",
        "3",
        "--turns",
        "2",
        "--user-len",
        "12",
        "--concurrency",
        "1",
        "--output-len",
        "6",
        "--seed",
        "4",
        "--tokenizer",
        "bundled",
        "--reset-prefix-cache",
        engine.url,
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr + engine.output()[-2000:]
    run = json.loads(out.read_text())["runs"]["run"]
    assert run["model"] == "SmolLM2-135M-Instruct" and run["completed"] == 6
    assert run["reset_prefix_cache"] == {engine.url: "ok"}
    assert all(r["prompt_tokens"] == r["oracle_prompt_tokens"] for r in run["requests"])
    cache = run["prefix_cache"]
    assert cache["prompt_tokens"] == cache["oracle_prompt_tokens"]
    assert 0 < cache["oracle_hit_rate"] <= cache["measured_hit_rate"]
    assert cache["measured_hit_rate"] == pytest.approx(cache["oracle_hit_rate_with_outputs"], abs=0.02)
