"""A prompt set larger than memory (issue 49): the sort demo launched on a synthetic 5-million-prompt Parquet
file and on a 1,000-prompt one, alternated, the same run otherwise (``--steps`` versions, 1 generator, 1
learner, no evaluation). Per run: the generator process's peak resident memory (``VmHWM``) and peak
anonymous memory (``RssAnon``: without the mapped Arrow file's pages, which are the kernel's shared, reclaimable
page cache and grow with the rows a run draws), polled from ``/proc`` until it exits, and the start-up, launch
to the first trained version. Prints the medians and the
differences, 5M minus 1k:

    .venv/bin/python scripts/bench/sources.py --rounds 3
    RESULT generator_peak_rss_delta_mb ...        # issue 49's bar: within 100 MB
    RESULT generator_peak_anon_rss_delta_mb ...
    RESULT startup_delta_s ...               # issue 49's bar: not more than 5 s

The Parquet files are made once under ``.cache/bench-sources`` (seeded: the same bytes each time); the first
launch on the large one converts it to ``datasets``' Arrow cache, timed apart (``cold_convert_s``), before the
rounds, which then all read the memory-mapped cache as a run's generators do.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "bench-sources"
LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)


def make_parquet(n: int, path: Path) -> Path:
    """``n`` sort prompts of 5 letters (``letters``, ``sorted``), seeded."""
    if path.exists():
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    picks = LETTERS[np.random.default_rng(n).integers(0, 26, (n, 5))]
    letters = picks.copy().view("S5").ravel().astype(str)
    ordered = np.sort(picks, axis=1).view("S5").ravel().astype(str)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"letters": letters, "sorted": ordered}), path, row_group_size=100_000)
    return path


def source(path: Path) -> str:
    return f"{{path: {path}, template: 'sort:{{letters}}=', columns: {{answer: sorted}}}}"


def launch(out_dir: Path, name: str, path: Path, steps: int) -> dict[str, float]:
    """One run: the generator's peak RSS and peak anonymous RSS (MB), and the seconds from launch to version 1."""
    sets = {"data.train": source(path), "run.steps": steps, "run.generators": 1, "run.learners": 1,
            "run.eval_every": 0, "run.out_dir": out_dir}  # fmt: skip
    cmd = [sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-cpu.yaml", "--name", name]
    cmd += [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    run_dir = out_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier bench's: its metrics would read as this run's
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak, anon, first = 0, 0, None
    while proc.poll() is None:
        now = generator_memory(run_dir)
        peak, anon = max(peak, now["VmHWM"]), max(anon, now["RssAnon"])
        if first is None and first_version(run_dir):
            first = time.monotonic() - t0
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    return {"rss_mb": peak / 2**20, "anon_mb": anon / 2**20, "startup_s": first if first is not None else float("nan")}


def generator_memory(run_dir: Path) -> dict[str, int]:
    """The generator process's resident bytes now: ``VmHWM`` (the peak of all of it) and ``RssAnon`` (its own
    memory, without the pages of mapped files: the Arrow cache's pages are the kernel's page cache, shared by
    every process that maps the file and given back under pressure). Zeros before it is up."""
    try:
        pid = json.loads((run_dir / "run.json").read_text())["pids"]["generator-0"]
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, KeyError, ValueError):
        return {"VmHWM": 0, "RssAnon": 0}
    fields = dict(line.split(":", 1) for line in status.splitlines())
    return {k: int(fields.get(k, "0").split()[0]) * 1024 for k in ("VmHWM", "RssAnon")}  # a zombie has none


def first_version(run_dir: Path) -> bool:
    try:
        return '"learner/version"' in (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--large", type=int, default=5_000_000, help="prompts in the large set")
    parser.add_argument("--out", type=Path, default=Path("/tmp/asyncrl-bench-sources"))
    args = parser.parse_args()
    small = make_parquet(1000, CACHE / "sort-1k.parquet")
    t = time.monotonic()
    large = make_parquet(args.large, CACHE / f"sort-{args.large}.parquet")
    print(f"data: {large.stat().st_size / 1e6:.0f} MB of Parquet ({time.monotonic() - t:.1f} s to write)")
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "asyncrl.cli", "launch", "--config", "configs/demo-cpu.yaml", "--set",
                    f"data.train={source(large)}", "--dry-run"], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    print(f"RESULT cold_convert_s {time.monotonic() - t:.1f}  # the dry-run that builds the Arrow cache once")
    runs: dict[str, list[dict]] = {"1k": [], "large": []}
    for r in range(args.rounds):
        for label, path in (("1k", small), ("large", large)) if r % 2 == 0 else (("large", large), ("1k", small)):
            runs[label].append(launch(args.out, f"{label}-{r}", path, args.steps))
            print(f"round {r} {label}: {runs[label][-1]}", flush=True)
    keys = ("rss_mb", "anon_mb", "startup_s")
    med = {label: {k: statistics.median(x[k] for x in rs) for k in keys} for label, rs in runs.items()}
    print(json.dumps(med))
    print(f"RESULT generator_peak_rss_delta_mb {med['large']['rss_mb'] - med['1k']['rss_mb']:.1f}")
    print(f"RESULT generator_peak_anon_rss_delta_mb {med['large']['anon_mb'] - med['1k']['anon_mb']:.1f}")
    print(f"RESULT startup_delta_s {med['large']['startup_s'] - med['1k']['startup_s']:.2f}")


if __name__ == "__main__":
    main()
