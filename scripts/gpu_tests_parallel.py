"""Run the GPU tests (``pytest -m gpu``) as many pytest processes at once, one per test function, so that a device
call of a few minutes covers the whole suite: most of a GPU test's time is Triton compiling its kernels on the CPU
(the GPU machine has 16 cores), which one pytest process does one kernel at a time.

    python scripts/gpu_tests_parallel.py [--jobs 8] [--budget 500] [--split 5] [--out DIR] [PATHS or test ids ...]

Each test function (all its parameter sets) runs in its own process, with its log in ``DIR/<file>__<function>.log``;
one of more than ``--split`` parameter sets runs as several processes of at most that many (``.part<k>`` logs), so
that a long battery (the Gluon forward's 20 cases, 167 s in one process) does not hold back a capped run alone.
Everything ends within ``--budget`` seconds: a group is stopped at the budget's end (listed as timed out), and
none starts in its last ``--min-start`` seconds (listed as not run). Prints one line a group (passed, failed,
skipped, errors, seconds, the failing ids) and a total; exits 1 if any test failed or errored, 2 if any group did
not run or timed out, else 0. Used by ``scripts/gpu_check.sh gpu_tests_par``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b\s*(?:\[(\d+)\])?\s*(\S*)")


def base_dir(paths: list[str]) -> Path:
    """Where pytest runs and what its test ids are relative to: the repo root, or for paths outside it (this
    script's own test) their common folder."""
    absolute = [(ROOT / p.split("::")[0]).resolve() for p in paths]
    if all(a.is_relative_to(ROOT) for a in absolute):
        return ROOT
    return Path(os.path.commonpath([a if a.is_dir() else a.parent for a in absolute]))


def collect(paths: list[str], marker: str, base: Path) -> dict[str, list[str]]:
    """``{file::function: [test ids]}`` of the tests ``pytest -m marker`` selects, in collection order."""
    paths = [str((ROOT / p.split("::")[0]).resolve()) + ("::" + p.split("::", 1)[1] if "::" in p else "")
             for p in paths]
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(base),
           "-m", marker, *paths]
    res = subprocess.run(cmd, cwd=base, capture_output=True, text=True)
    groups: dict[str, list[str]] = {}
    for line in res.stdout.splitlines():
        if "::" not in line or line.startswith(" "):
            continue
        test_id = line.strip()
        groups.setdefault(test_id.split("[", 1)[0], []).append(test_id)
    if not groups and res.returncode not in (0, 5):
        sys.exit(f"gpu_tests_parallel: collection failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    return groups


def split_groups(groups: dict[str, list[str]], size: int) -> dict[str, list[str] | None]:
    """``{name: test ids to run, or None for the whole function}``: a function of more than ``size`` test ids
    (``size`` > 0) becomes parts of at most ``size``, named ``function [part k/K]``."""
    out: dict[str, list[str] | None] = {}
    for group, ids in groups.items():
        if size <= 0 or len(ids) <= size:
            out[group] = None
            continue
        parts = [ids[i:i + size] for i in range(0, len(ids), size)]
        for k, part in enumerate(parts, 1):
            out[f"{group} [part {k}/{len(parts)}]"] = part
    return out


def run_group(group: str, marker: str, out: Path, timeout: float, base: Path, ids: list[str] | None = None) -> dict:
    name, _, part = group.partition(" [part ")
    log = out / (name.split("/")[-1].replace(".py::", "__") + (f".part{part.split('/')[0]}" if part else "") + ".log")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "--rootdir", str(base), "-m", marker,
           *(ids or [group])]
    start = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=base, capture_output=True, text=True, timeout=timeout)
        text, code = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = "timeout"
    log.write_text(text)
    counts = {"PASSED": 0, "FAILED": 0, "ERROR": 0, "SKIPPED": 0}
    failing = []
    for line in text.splitlines():
        m = OUTCOME.match(line)
        if m:  # "-rA" lines; skips of one reason come as "SKIPPED [n] file:line: reason"
            kind = m.group(1) if m.group(1) in counts else "PASSED" if m.group(1) == "XPASS" else "SKIPPED"
            counts[kind] += int(m.group(2) or 1)
            if kind in ("FAILED", "ERROR"):
                failing.append(m.group(3))
    if code not in (0, 5, "timeout") and not failing:  # the process died (a CUDA fault, a signal) before reporting
        counts["ERROR"] += 1
        failing.append(f"{group} (pytest exit {code})")
    return dict(group=group, code=code, seconds=time.monotonic() - start, failing=failing, log=log.name, **counts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", default=["tests/"])
    ap.add_argument("--jobs", type=int, default=8, help="pytest processes at once")
    ap.add_argument("--budget", type=float, default=500.0, help="seconds for the whole run")
    ap.add_argument("--min-start", type=float, default=20.0, help="no group starts with fewer seconds left")
    ap.add_argument("--group-timeout", type=float, default=400.0, help="seconds one group may run")
    ap.add_argument("--split", type=int, default=5, help="parameter sets a process runs at most (0: a whole function)")
    ap.add_argument("--marker", default="gpu")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "gpu_check_out"), "gpu_tests"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = base_dir(args.paths)
    collected = collect(args.paths, args.marker, base)
    groups = split_groups(collected, args.split)
    print(f"{sum(map(len, collected.values()))} tests in {len(groups)} groups, {args.jobs} at once", flush=True)
    start = time.monotonic()
    results, not_run = [], []
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        def submit(group):
            left = args.budget - (time.monotonic() - start)
            if left < args.min_start:
                not_run.append(group)
                return None
            return run_group(group, args.marker, out, min(args.group_timeout, left), base, groups[group])

        # printed as each group ends (not in submission order), so a run cut short still shows what finished
        for fut in cf.as_completed([pool.submit(submit, g) for g in groups]):
            r = fut.result()
            if r is None:
                continue
            results.append(r)
            status = "timeout" if r["code"] == "timeout" else f"exit {r['code']}"
            print(f"  {r['PASSED']:3d} passed {r['FAILED']:2d} failed {r['ERROR']:2d} errors {r['SKIPPED']:2d} skipped "
                  f"{r['seconds']:6.1f}s {status:8s} {r['group']}"
                  + (f"  FAILING: {' '.join(r['failing'])}" if r["failing"] else ""), flush=True)
    total = {k: sum(r[k] for r in results) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    timeouts = [r["group"] for r in results if r["code"] == "timeout"]
    print(f"total: {total['PASSED']} passed, {total['FAILED']} failed, {total['ERROR']} errors, {total['SKIPPED']} "
          f"skipped in {time.monotonic() - start:.0f} s; {len(timeouts)} group(s) timed out, {len(not_run)} not run")
    for g in timeouts:
        print(f"  timed out: {g}")
    for g in not_run:
        print(f"  not run: {g}")
    if total["FAILED"] or total["ERROR"]:
        return 1
    return 2 if timeouts or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
