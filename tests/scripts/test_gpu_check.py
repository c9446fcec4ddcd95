"""scripts/gpu_check.sh cannot rot: CI runs it on the CPU (`--device cpu --quick`).

Specification: the check runs its four stages (env, tests, forward, decode) as one command,
each logged and timed, and writes a results table; every stage passes on the CPU, and the
device tests it runs really ran (some passed, none failed). A stage that fails is recorded as
FAILED and the script exits non-zero (checked with an unknown device).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.processes, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STAGES = ("env", "tests", "forward", "decode")


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", *args, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    results = (out / "results.md").read_text() if (out / "results.md").exists() else ""
    return proc, results


def test_the_gpu_check_passes_on_the_cpu_and_writes_its_results(tmp_path):
    proc, results = _run(tmp_path, "--device", "cpu", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in STAGES:
        assert re.search(rf"^\| {stage} \| ok \| \d+ \|$", results, re.M), f"stage {stage} not ok:\n{results}"
    tests_log = (tmp_path / "results" / "tests.log").read_text()
    passed = re.search(r"(\d+) passed", tests_log)
    assert passed and int(passed.group(1)) >= 5 and " failed" not in tests_log
    assert "ours dspark" in (tmp_path / "results" / "decode.log").read_text()  # the speculative row ran


def test_a_failing_stage_is_recorded_and_fails_the_check(tmp_path):
    proc, results = _run(tmp_path, "--device", "tpu", "--quick")
    assert proc.returncode == 1
    assert re.search(r"^\| env \| FAILED \(rc \d+\) \|", results, re.M)
