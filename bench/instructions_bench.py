"""Instructions per proxied request, counted by callgrind: a cost figure that a busy or throttled VM cannot move.

    .venv/bin/python -m bench.instructions_bench --baseline /tmp/base [--seconds 30]
    .venv/bin/python -m bench.instructions_bench --keys     # a stored key + budget against the static key

On a 2-core VM shared with other jobs, RPS and CPU time per request move by a third between rounds, more than the
differences worth measuring. Valgrind's instruction count does not. Each gateway (this checkout, then the
`--baseline` checkout) runs under `valgrind --tool=callgrind` with instrumentation off while it starts and warms up
(its first request loads tokenizers lazily), then on for `--seconds` of `wrk -c4` load against proxy_bench.py's
static nginx upstream, with auth, the repository's policies and the access log on. The figure is the event loop's
and its threads' instructions over the requests completed; under valgrind a gateway serves tens of requests a second,
so what it does by the clock (a key store's poll, the ledger's flush) is counted apart, over as long with no load,
and taken out in `per_request_less_idle`. Needs valgrind, nginx and wrk.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.gateways import start_portcullis
from bench.harness.processes import Procs, Service, wait_http
from bench.harness.upstream import API_KEY, REQUEST, start_static_upstream
from bench.harness.wrk import WRK_LUA
from bench.proxy.keys import BUDGETS_POLICY, NO_BUDGETS_POLICY, store_key


def wrk(port: int, lua: Path, connections: int, seconds: int, counted: bool = True) -> int:
    """Requests completed; under valgrind a request takes milliseconds, so the timeout is generous. A counted run
    must have no failures (a warm-up may: the very first request can outlast an upstream timeout while it loads)."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "60s", "-s", str(lua)]
    out = subprocess.run([*argv, f"http://127.0.0.1:{port}/v1/chat/completions"], capture_output=True, text=True)
    if counted and ("Non-2xx" in out.stdout or "Socket errors" in out.stdout):
        raise RuntimeError(f"wrk saw failed requests:\n{out.stdout}")
    match = re.search(r"(\d+) requests in", out.stdout)
    if match is None:
        raise RuntimeError(f"wrk printed no request count:\n{out.stdout}{out.stderr}")
    return int(match.group(1))


# --keys: the key and spend rows of proxy_bench.py's --keys, counted: (static key, no budget) against (a key from
# the SQLite key store, a budget rule every request reserves on and settles)
KEY_ROWS = ("static_key", "stored_key_budget")


def instructions_per_request(name: str, checkout: Path | None, seconds: int, tmp: Path, keys: str = "") -> dict:
    """`keys`: "" (the config's key, the repository's policies), or one of KEY_ROWS' names."""
    procs = Procs()
    out_file = tmp / f"{name}.callgrind"
    start = Procs.start

    def under_valgrind(self: Procs, label: str, argv: list[str], *args: object, **kwargs: object) -> Service:
        if label == name:
            argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", *argv]
        return start(self, label, argv, *args, **kwargs)

    Procs.start = under_valgrind
    try:
        secret = store_key("sqlite", tmp, name) if keys == "stored_key_budget" else API_KEY  # before it starts
        lua = tmp / f"{name}.lua"
        body = json.dumps(REQUEST, separators=(",", ":"))
        lua.write_text(WRK_LUA.replace("@BODY@", body).replace("@KEY@", secret))
        static = start_static_upstream(procs, tmp, f"static-{name}")
        if keys:
            budget = keys == "stored_key_budget"
            policy = BUDGETS_POLICY if budget else NO_BUDGETS_POLICY
            gateway = start_portcullis(
                procs, tmp, name, static.port, False, policy=policy, static_key=not budget, checkout=checkout
            )
        else:
            gateway = start_portcullis(procs, tmp, name, static.port, True, checkout=checkout)
        wait_http(gateway, "/healthz", 900)
        wrk(gateway.port, lua, 1, 30, counted=False)  # the first request loads what is lazy; then the steady state
        wrk(gateway.port, lua, 4, 15, counted=False)
        pid = str(gateway.proc.pid)
        subprocess.run(["callgrind_control", "--instr=on", pid], check=True, capture_output=True)
        subprocess.run(["callgrind_control", "--zero", pid], check=True, capture_output=True)
        requests = wrk(gateway.port, lua, 4, seconds)
        instructions = dumped(tmp, name, pid)
        time.sleep(seconds)  # no load: what the gateway does by the clock (store polls, flushes) over as long
        idle = dumped(tmp, name, pid)
        subprocess.run(["callgrind_control", "--instr=off", pid], check=True, capture_output=True)
        return {
            "requests": requests,
            "instructions": instructions,
            "per_request": round(instructions / requests),
            "idle_instructions": idle,
            "per_request_less_idle": round((instructions - idle) / requests),
        }
    finally:
        Procs.start = start
        procs.stop_all()


def dumped(tmp: Path, name: str, pid: str) -> int:
    """The instructions counted since the last dump (or zeroing): dumps them and reads the new dump's total."""
    before = set(tmp.glob(f"{name}.callgrind*"))
    subprocess.run(["callgrind_control", "--dump", pid], check=True, capture_output=True)
    time.sleep(1)
    (dump,) = set(tmp.glob(f"{name}.callgrind*")) - before
    return max(
        int(line.split()[1])
        for line in dump.read_text(errors="replace").splitlines()
        if line.startswith(("summary:", "totals:"))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="an earlier checkout (git worktree) to count side by side")
    parser.add_argument("--seconds", type=int, default=30, help="seconds of counted load per gateway (default 30)")
    parser.add_argument("--keys", action="store_true", help="a stored key with a budget against the static key")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="portcullis-instructions-"))
    tmp.chmod(0o755)
    if args.keys:
        rows = {name: instructions_per_request(name, None, args.seconds, tmp, name) for name in KEY_ROWS}
        if args.baseline:  # the same two rows on the earlier commit
            for name in KEY_ROWS:
                rows[f"baseline_{name}"] = instructions_per_request(
                    f"baseline_{name}", args.baseline, args.seconds, tmp, name
                )
        for name, row in rows.items():
            print(
                f"{name:26} {row['per_request']:>10,} instructions per request, {row['per_request_less_idle']:>10,} "
                f"less what it does idle ({row['requests']} requests)"
            )
        for field in ("per_request", "per_request_less_idle"):
            ratio = rows["stored_key_budget"][field] / rows["static_key"][field]
            print(f"{field}: stored key + budget / static key {ratio:.3f}")
            if args.baseline:
                for name in KEY_ROWS:
                    ratio = rows[name][field] / rows[f"baseline_{name}"][field]
                    print(f"{field}: {name} / the same on the baseline {ratio:.3f}")
        print(json.dumps(rows))
        return 0
    rows = {"current": instructions_per_request("current", None, args.seconds, tmp)}
    if args.baseline:
        rows["baseline"] = instructions_per_request("baseline", args.baseline, args.seconds, tmp)
    for name, row in rows.items():
        print(f"{name:9} {row['per_request']:>10,} instructions per request ({row['requests']} requests)")
    if "baseline" in rows:
        print(f"ratio current / baseline: {rows['current']['per_request'] / rows['baseline']['per_request']:.3f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
