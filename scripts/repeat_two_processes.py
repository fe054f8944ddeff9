"""Run every two-process test (marked `two_processes`: torchrun with 2 gloo processes) again and again, and count
the failures of each: a teardown that aborts now and then shows here, not in one CI run in eight.

    .venv/bin/python scripts/repeat_two_processes.py                # 30 rounds of every two-process test
    .venv/bin/python scripts/repeat_two_processes.py --rounds 5 -k fsdp

Each round is one pytest run of the selected tests (`-m two_processes`), its report kept as OUT/round-N.xml.
Several of these tests start `torchrun --nproc-per-node 2 -m recurfit train` (DDP or FSDP2) and require exit
code 0; the table counts those runs too. Progress (rate, ETA) goes to stderr, the table to stdout; the exit
status is 1 if any run failed. docs/contributing.md records the counts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

from recurfit.progress import progress_bar

REPO = Path(__file__).resolve().parent.parent

# The tests that start `torchrun … -m recurfit train` (through conftest.one_and_two_processes), by strategy.
CLI_RUNS = {
    "ddp": ("test_two_processes_match_one_with_the_same_global_batch", "test_two_processes_match_one_under_muon"),
    "fsdp": (
        "test_fsdp2_with_a_depth_per_micro_batch_trains_as_one_process",
        "test_fsdp2_shards_the_teacher_and_matches_one_process",
        "test_fsdp2_with_gathered_muon_matches_one_process",
        "test_fsdp2_with_frozen_parts_matches_one_process",
    ),
}


def one_round(report: Path, select: str | None) -> dict[str, str | None]:
    """Each selected test's outcome in one pytest run: None if it passed, else the end of its failure."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "two_processes", "-p", "no:cacheprovider"]
    command += [f"--junitxml={report}", *(["-k", select] if select else []), "tests/"]
    subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not report.exists():
        raise SystemExit(f"pytest wrote no report ({report}): run `{' '.join(command)}` to see why.")
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        name = f"{case.get('classname', '').rpartition('.')[2]}.py::{case.get('name')}"
        outcomes[name] = None if failure is None else (failure.get("message") or "")[-300:]
    return outcomes


def cli_runs(test: str) -> str | None:
    """The strategy of the `recurfit train` run under torchrun that `test` starts, if it starts one."""
    return next((strategy for strategy, tests in CLI_RUNS.items() if test.split("::")[1].startswith(tests)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("-k", dest="select", help="pytest's -k: only the tests it selects")
    parser.add_argument("--out", type=Path, help="folder for the rounds' reports (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="two-processes-"))
    out.mkdir(parents=True, exist_ok=True)
    runs, failures, messages = Counter(), Counter(), {}
    with progress_bar() as bar:
        task = bar.add_task("rounds", total=args.rounds)
        for index in range(args.rounds):
            for test, failure in one_round(out / f"round-{index + 1}.xml", args.select).items():
                runs[test] += 1
                if failure is not None:
                    failures[test] += 1
                    messages.setdefault(test, f"round {index + 1}: {failure}")
            bar.update(task, advance=1)
    cli = Counter()
    for test, count in runs.items():
        if cli_runs(test):
            cli[cli_runs(test)] += count
    print(f"{args.rounds} rounds; reports in {out}")
    print(f"{'failures':>8} {'runs':>5}  test")
    for test in sorted(runs):
        print(f"{failures[test]:>8} {runs[test]:>5}  {test}")
    print(f"torchrun --nproc-per-node 2 -m recurfit train inside them: {cli['ddp']} DDP runs, {cli['fsdp']} FSDP2 runs")
    for test, message in messages.items():
        print(f"first failure of {test}: {message}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
