"""The test SLURM cluster (`sudo .ci/slurm_up.sh`): whether it answers, and the fixture's rule for when it does not
(skip outside CI; with CI=true, fail: .ci/run starts it)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")
# .ci/slurm_up.sh's partition of two slurmd nodes on one host
MULTINODE_PARTITION = "multinode"


def slurm_down_reason(partition: str | None = None, nodes: int = 1) -> str | None:
    """None when sbatch is here and `nodes` nodes (of `partition`, default: any) are up; else why not."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    where = ["--partition", partition] if partition else []
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--Node", *where, "--format=%t"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    states = out.stdout.split()
    if sum(s.rstrip("*~#!%$@^-") in ("idle", "mix", "alloc") for s in states) < nodes:
        return f"fewer than {nodes} node(s) up{f' in partition {partition}' if partition else ''} (sinfo: {states})"
    return None


def require_cluster(partition: str | None = None, nodes: int = 1) -> None:
    why = slurm_down_reason(partition, nodes)
    if why is not None:
        if IN_CI:
            pytest.fail(f"CI=true but no SLURM cluster answers ({why}); .ci/run starts one with .ci/slurm_up.sh")
        pytest.skip(f"no SLURM cluster here ({why}); start one with: sudo .ci/slurm_up.sh")
