#!/usr/bin/env python3
"""The GPU gate: the sources the GPU tests stand for (GPU_PATH), the GPU test list in parts that each fit one device
call (PARTS), the record a device run of one part leaves (write_record), and the check CI makes against the records.

    python3 tools/gpu_gate.py parts                  the part names, one a line
    python3 tools/gpu_gate.py files PART             the part's test files, space-separated
    python3 tools/gpu_gate.py options PART           the part's pytest options (PART_OPTIONS), space-separated
    python3 tools/gpu_gate.py record --out DIR --junit XML --part PART --rc N   (tools/device_run.sh, after pytest)
    python3 tools/gpu_gate.py check [--records DIR]  exit 1, saying why and what to run, unless the records cover
                                                     this checkout's GPU-path sources (tests/test_gpu_gate.py)

A record holds the sha256 of the GPU-path sources of the tree that ran, so a change to any of them needs a new green
GPU run before CI passes, and a change elsewhere keeps the records it had. Standard library only (the device's Python
3.12, CI's 3.11); torch and Triton are imported, lazily, only to name their versions in a record.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = "tests/gpu_records"  # where records are committed, relative to the repository root
RECORD_GLOB = "gpu_record-*.json"

# The GPU test list, in parts run one a device call (a call has 600 s), each sized to about 190 s by the files' GPU
# times (docs/vllm-on-device.md, "The GPU gate"): the Triton and the Gluon kernel files take most of it, the core /
# serving / DCP files ride where a part has room. `smoke` comes first in every session that changes a kernel.
PARTS: dict[str, tuple[str, ...]] = {
    "smoke": ("tests/test_gpu_smoke.py",),  # at most 240 s
    "triton": ("tests/test_convert.py", "tests/test_triton_decode.py", "tests/test_lead_split.py"),
    "gluon": (
        "tests/test_gluon_decode.py", "tests/test_gluon_seesaw.py", "tests/test_gluon_partials.py",
        "tests/test_gluon_selection.py", "tests/test_core.py", "tests/test_bad_input.py", "tests/test_serving.py",
    ),
    "few-heads": ("tests/test_gluon_few_heads.py", "tests/test_dcp.py", "tests/test_graphs.py"),
}
# pytest options a part runs with (recorded with it): the GPU tests share no files, ports or process state, and most
# of their time is Triton compiling (one CPU core a compile), so pytest-xdist spreads them over 8 of the device's 16
# cores, 8 processes on the one GPU
PART_OPTIONS: dict[str, tuple[str, ...]] = {part: ("-n", "8") for part in PARTS}
GPU_TESTS: tuple[str, ...] = tuple(f for files in PARTS.values() for f in files)

# What the GPU tests run and import: the kernels, their planning and dispatch, the core and serving code around them,
# and the tests' own helpers (every tests/*.py module a GPU test file imports; tests/test_gpu_gate.py holds this list
# to the imports). Their hash is a record's sources_sha256; a GPU test file's own hash counts for its part's records
# only, so an edit of one test file asks for a new run of its part alone.
TEST_HELPERS: tuple[str, ...] = ("tests/conftest.py", "tests/decode_checks.py", "tests/dcp_cases.py",
                                 "tests/served_forms.py")
SOURCES: tuple[str, ...] = (
    "vllm_kimi_dsa/kernels/", "vllm_kimi_dsa/planning/", "vllm_kimi_dsa/backends/hopper/",
    "vllm_kimi_dsa/backends/registry.py", "vllm_kimi_dsa/selection/", "vllm_kimi_dsa/convert.py",
    "vllm_kimi_dsa/core.py", "vllm_kimi_dsa/serving.py", "vllm_kimi_dsa/dcp.py", "vllm_kimi_dsa/formats.py",
    "vllm_kimi_dsa/widths.py", "vllm_kimi_dsa/heads.py", "vllm_kimi_dsa/host_math.py", "vllm_kimi_dsa/arguments.py",
    "vllm_kimi_dsa/envs.py", "vllm_kimi_dsa/reference.py", "vllm_kimi_dsa/synthetic.py", "vllm_kimi_dsa/vllm_glue.py",
) + TEST_HELPERS
GPU_PATH: tuple[str, ...] = SOURCES + GPU_TESTS

# the switches that change which kernels the tests run (vllm_kimi_dsa/envs.py); --t38 shows as the Triton version
KERNEL_SWITCHES = ("VLLM_KIMI_DSA_GLUON", "VLLM_KIMI_DSA_FP8_PV")

RERUN = ("run the GPU tests on the device, smoke first (`bash tools/device_run.sh tests part=NAME`, "
         "NAME in " + ", ".join(PARTS) + f") and commit $OUT/{RECORD_GLOB} into {RECORDS}/ "
         "(docs/vllm-on-device.md, \"The GPU gate\")")


def source_hashes(root: Path | str = ROOT) -> dict[str, str]:
    """{path relative to root: sha256 of its bytes} of every *.py file under GPU_PATH present in root, sorted."""
    root = Path(root)
    found: set[Path] = set()
    for entry in GPU_PATH:
        path = root / entry
        if entry.endswith("/"):
            found.update(p for p in path.rglob("*.py") if "__pycache__" not in p.parts)
        elif path.is_file():
            found.add(path)
    rel = sorted(p.relative_to(root).as_posix() for p in found)
    return {r: hashlib.sha256((root / r).read_bytes()).hexdigest() for r in rel}


def sources_hash(hashes: dict[str, str]) -> str:
    """The sha256 of the sources, the GPU test files left out: over `sha256sum`'s lines ("<file sha256>  <path>") of
    every other file, sorted by path."""
    listing = "".join(f"{digest}  {path}\n" for path, digest in sorted(hashes.items()) if path not in GPU_TESTS)
    return hashlib.sha256(listing.encode()).hexdigest()


def junit_counts(junit_xml: Path | str) -> dict[str, int | float]:
    """passed / failed / skipped / errors, one a test case (a failure outranks an error, an error a skip), and the
    pytest session's seconds, from a pytest --junitxml file."""
    tree = ET.parse(junit_xml)
    counts: dict[str, int | float] = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for case in tree.iter("testcase"):
        tags = {child.tag for child in case}
        key = ("failed" if "failure" in tags else "errors" if "error" in tags else
               "skipped" if "skipped" in tags else "passed")
        counts[key] += 1
    counts["seconds"] = round(sum(float(s.get("time", 0)) for s in tree.iter("testsuite")), 1)
    return counts


def _card() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # no torch, or a torch that cannot reach the card: the record says no card
        return None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # absent or broken: the record says so by a null
        return None


def _commit(root: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and (root / ".git").exists() else None


def write_record(out_dir: Path | str, junit_xml: Path | str, test_files: list[str] | tuple[str, ...], part: str, *,
                 pytest_rc: int, root: Path | str = ROOT, card: str | None = None,
                 versions: dict[str, str | None] | None = None, now: datetime.datetime | None = None) -> Path:
    """Write out_dir/gpu_record-<part>-<sources hash[:12]>-<UTC time>.json (a new name, never an existing record's)
    for one pytest run of test_files, and return its path.

    out_dir: an existing folder; junit_xml: that run's --junitxml file (absent when pytest was killed: the record then
    has no counts); test_files: paths relative to root; part: a name of PARTS; pytest_rc: pytest's exit status (124:
    killed at its limit); root: the tree that ran, hashed here; card, versions ({"torch", "triton", "python"}) and now:
    detected when None (nvidia-smi, then torch; the imported modules; the clock).
    """
    if part not in PARTS:
        raise ValueError(f"part={part!r} is not one of {', '.join(PARTS)}")
    if not test_files:
        raise ValueError("test_files is empty: a record stands for the test files it ran")
    root = Path(root)
    hashes = source_hashes(root)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if versions is None:
        versions = {"torch": _version("torch"), "triton": _version("triton"), "python": platform.python_version()}
    junit = Path(junit_xml)
    record = {
        "part": part,
        "sources_sha256": sources_hash(hashes),
        "test_files": list(test_files),
        "pytest_rc": int(pytest_rc),
        "pytest_options": list(PART_OPTIONS.get(part, ())),
        "tests": junit_counts(junit) if junit.is_file() else None,
        "card": card if card is not None else _card(),
        "versions": versions,
        "env": {name: os.environ.get(name) for name in KERNEL_SWITCHES},
        "commit": _commit(root),
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "files_sha256": hashes,
    }
    stem = f"gpu_record-{part}-{record['sources_sha256'][:12]}-{now.strftime('%Y%m%dT%H%M%SZ')}"
    path = Path(out_dir) / f"{stem}.json"
    for again in range(2, 1000):  # another run of this part within the same second: never overwrite a record
        if not path.exists():
            break
        path = Path(out_dir) / f"{stem}-{again}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def record_problems(record: dict) -> list[str]:
    """Why a record does not show its test files passing on a GPU (empty: it does)."""
    tests = record.get("tests")
    problems = []
    if record.get("pytest_rc") != 0:
        problems.append(f"pytest exited {record.get('pytest_rc')} (124: cut at its time limit)")
    if tests is None:
        problems.append("no test counts (pytest wrote no junit xml)")
    else:
        problems += [f"{tests[k]} {k}" for k in ("failed", "errors") if tests.get(k)]
        if not tests.get("passed"):
            problems.append("nothing passed")
    if not record.get("card"):
        problems.append("no GPU named (not run on a GPU)")
    return problems


def _describe(name: str, record: dict) -> str:
    return f"{name} (part {record.get('part')}, {record.get('card')}, {record.get('date')})"


def check(records_dir: Path | str | None = None, root: Path | str = ROOT) -> list[str]:
    """What stands between root's GPU-path sources and a green GPU record of them: one sentence a problem, each
    saying what to do; empty when the records whose sources hash equals root's all passed and together ran every
    file of the GPU list.

    records_dir: the committed records (default root/tests/gpu_records; absent counts as none); root: the checkout.
    """
    root = Path(root)
    folder = Path(records_dir) if records_dir is not None else root / RECORDS
    problems = [f"the GPU list names {f}, which the checkout lacks: add it or take it out of PARTS "
                "(tools/gpu_gate.py)" for f in GPU_TESTS + TEST_HELPERS if not (root / f).is_file()]
    hashes = source_hashes(root)
    digest = sources_hash(hashes)
    records: dict[str, dict] = {}
    for path in sorted(folder.glob(RECORD_GLOB)) if folder.is_dir() else []:
        try:
            records[path.name] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: not a record ({exc}); remove it, records are written by the runner only")
    same = {name: r for name, r in records.items() if r.get("sources_sha256") == digest}
    # a record counts for this checkout when its test files are the checkout's too (an edited test file needs its
    # part run again; the record of its old text neither passes nor fails it)
    matching = {name: r for name, r in same.items()
                if all(r.get("files_sha256", {}).get(f) == hashes.get(f) for f in r.get("test_files", ()))}
    if not same:
        said = f"no GPU record in {folder} is of this checkout's GPU-path sources (sha256 {digest[:12]})"
        if records:
            name, newest = max(records.items(), key=lambda item: str(item[1].get("date")))
            old = newest.get("files_sha256", {})
            changed = sorted(p for p in hashes.keys() & old.keys() if hashes[p] != old[p])
            lists = [f"{what}: {', '.join(paths)}" for what, paths in (
                ("changed", changed), ("added", sorted(hashes.keys() - old.keys())),
                ("removed", sorted(old.keys() - hashes.keys()))) if paths]
            said += f"; against the newest, {_describe(name, newest)}, " + "; ".join(lists or ["nothing differs"])
        return problems + [f"{said}. To pass, {RERUN}."]
    for name, record in matching.items():
        bad = record_problems(record)
        if bad:
            problems.append(f"{_describe(name, record)}: {', '.join(bad)}. The GPU tests do not pass on these "
                            f"sources: fix them, then {RERUN}.")
    ran = {f for r in matching.values() if not record_problems(r) for f in r.get("test_files", ())}
    unrun = [f for f in GPU_TESTS if f not in ran]
    if unrun:
        parts = sorted({p for p, files in PARTS.items() for f in unrun if f in files}, key=list(PARTS).index)
        problems.append(f"no passing GPU record of these sources (sha256 {digest[:12]}) ran {', '.join(unrun)}: run "
                        + ", ".join(f"`bash tools/device_run.sh tests part={p}`" for p in parts)
                        + f" on the device and commit $OUT/{RECORD_GLOB} into {RECORDS}/.")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("parts")
    files = sub.add_parser("files")
    files.add_argument("part", choices=list(PARTS))
    options = sub.add_parser("options")
    options.add_argument("part", choices=list(PARTS))
    record = sub.add_parser("record")
    record.add_argument("--out", required=True, type=Path)
    record.add_argument("--junit", required=True, type=Path)
    record.add_argument("--part", required=True, choices=list(PARTS))
    record.add_argument("--rc", required=True, type=int, help="pytest's exit status")
    record.add_argument("--card", help="the GPU's name (default: nvidia-smi's, else torch's)")
    gate = sub.add_parser("check")
    gate.add_argument("--records", type=Path, help=f"default: {RECORDS}")
    args = parser.parse_args(argv)
    if args.command == "parts":
        print("\n".join(PARTS))
    elif args.command == "files":
        print(" ".join(PARTS[args.part]))
    elif args.command == "options":
        print(" ".join(PART_OPTIONS.get(args.part, ())))
    elif args.command == "record":
        path = write_record(args.out, args.junit, PARTS[args.part], args.part, pytest_rc=args.rc, card=args.card)
        made = json.loads(path.read_text())
        counts = made["tests"] or {}
        print(f"{path.name}: sources {made['sources_sha256'][:12]}, {counts.get('passed', 0)} passed, "
              f"{counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, on {made['card'] or 'no GPU'}")
    else:
        problems = check(args.records)
        print("\n".join(problems) or "the GPU records cover these sources")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
