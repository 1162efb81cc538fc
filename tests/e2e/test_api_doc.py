"""docs/api.md's example, run as written on a lab: the first python block of the page, in a copy
of the playbook it loads, with the lab's inventory given as ORCH_INVENTORY (as a user's `orch lab
up` gives it to the playbook's own `inventory:` path)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.lab


def test_the_api_page_example_runs_as_written(lab, tmp_path):
    page = (REPO / "docs" / "api.md").read_text()
    example = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert 'orch.load("playbooks/mpi-allreduce/cluster.yaml")' in example
    shutil.copytree(REPO / "playbooks" / "mpi-allreduce", tmp_path / "playbooks" / "mpi-allreduce")
    env = {**os.environ, "ORCH_INVENTORY": str(lab.inventory_path)}
    res = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("6 ranks on ") and "succeeded 0" in lines
    assert re.search(r"^epoch: \d+, step: \d+, loss is ", res.stdout, re.M)     # rank 3's own output
    assert re.search(r"^rank 3/6 on \S+: weights checksum [0-9a-f]{16}$", res.stdout, re.M)
    assert lines[-1] == "succeeded"
