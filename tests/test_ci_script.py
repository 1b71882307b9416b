"""`.ci/run`'s exit status, with every command it runs replaced by a stub.

Stop 40's CI passed every stage and still exited 1: `set -e` applies inside the EXIT trap, and the trap's `kill` of a
prefetch job that had already ended failed. These tests run the real script against a fake `make` and fake install
scripts (each ~0.3 s), so the whole control flow — prefetch, stages, trap, exit — runs in a few seconds.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mock_repo(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory holding the real `.ci/run`, stub install scripts and a `make` that fails on `$FAIL`'s target."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    for name in ("install_sglang.sh", "install_vllm.sh"):
        (tmp_path / ".ci" / name).write_text("sleep 0.3\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    make = bin_dir / "make"
    make.write_text('#!/bin/bash\necho "stub make $*"; sleep 0.2\n[ "$*" != "${FAIL:-}" ]\n')
    make.chmod(make.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return tmp_path, env


def _run(repo: Path, env: dict[str, str], fail: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", ".ci/run"], cwd=repo, env={**env, "FAIL": fail}, capture_output=True, text=True, timeout=120
    )


def test_ci_exits_zero_when_every_stage_passes(tmp_path: Path) -> None:
    repo, env = _mock_repo(tmp_path)
    proc = _run(repo, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for stage in ("test-sglang", "test-slow", "test-planted", "test-tp", "test-llamacpp", "test-vllm"):
        assert f"{stage}: PASSED" in proc.stdout
    assert "total:" in proc.stdout


@pytest.mark.parametrize("target", ["test-tp", "test-vllm"])
def test_ci_exits_nonzero_when_a_stage_fails_and_still_runs_the_rest(tmp_path: Path, target: str) -> None:
    repo, env = _mock_repo(tmp_path)
    proc = _run(repo, env, fail=target)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{target}: FAILED" in proc.stdout
    assert "test-vllm:" in proc.stdout and "total:" in proc.stdout  # later stages still ran


def test_ci_stops_at_a_failed_readme_test_command(tmp_path: Path) -> None:
    repo, env = _mock_repo(tmp_path)
    proc = _run(repo, env, fail="test")
    assert proc.returncode == 1
    assert "make test: FAILED" in proc.stdout and "test-sglang" not in proc.stdout
