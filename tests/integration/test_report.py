"""`orch report`: a real local run's page, opened in a real headless browser (Chromium from
Debian's packages): every chart has drawn data points; the figures match the logs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
TRAIN = ("import os, sys, time\n"
         "rank = int(os.environ['RANK_ID'])\n"
         "steps = 12 if rank == 3 else 40\n"            # rank 3 lags
         "for s in range(1, steps + 1):\n"
         "    print('epoch: 1, step: %d, loss is %.4f acc=%.3f' % (s, 2.0 / s + rank, s / 50.0), flush=True)\n"
         "    time.sleep(0.1 if rank == 3 else 0.02)\n"
         "if rank == 2:\n"
         "    time.sleep(3.0)\n"   # past the second load sample (2 s after the start): its CPU figure
         "    print('Traceback: something broke on rank 2', flush=True)\n"
         "    sys.exit(3)\n"
         "time.sleep(30)\n")
ORCH = [sys.executable, "-m", "orchestrator.cli"]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: scripts/test.sh installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def test_the_report_opens_offline_and_every_chart_has_points(tmp_path, monkeypatch):
    browser = chromium()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "cluster.yaml").write_text(
        "inventory: {hosts: [{address: 127.0.0.1, connection: local, slots: 4}]}\n"
        f"job: {{workdir: {tmp_path}/wd, launcher: ranktable, command: [{PY}, {tmp_path}/train.py],\n"
        "      metrics: {acc: 'acc=([0-9.]+)'}}\n")
    up = subprocess.run(ORCH + ["up", "--skip-checks"], capture_output=True, text=True, timeout=180)
    assert up.returncode == 1, up.stdout + up.stderr            # rank 2 failed
    got = subprocess.run(ORCH + ["report", "--out", str(tmp_path / "r.html")], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    page = (tmp_path / "r.html").read_text()
    assert "cdn" not in page.lower().split("<script>")[0] and "src=\"http" not in page   # nothing fetched
    run_dir = next((tmp_path / ".orch" / "runs").iterdir())
    # metrics.jsonl beside the gathered logs: the numbers of the logs, read here on their own
    recs = [json.loads(ln) for ln in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    for r in range(4):
        log = (run_dir / "logs" / f"rank.{r}" / "stdout").read_text()
        want = [(int(s), float(loss), float(acc)) for s, loss, acc in
                re.findall(r"step: (\d+), loss is ([0-9.]+) acc=([0-9.]+)", log)]
        mine = [(x["step"], x["loss"], x["values"]["acc"]) for x in recs if x["rank"] == r]
        assert mine == want and want, r
    # a real browser runs the page's scripts; each chart must have drawn points
    shot = tmp_path / "shot.png"
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--virtual-time-budget=15000", "--window-size=1200,4000", "--dump-dom",
                          (tmp_path / "r.html").as_uri()], capture_output=True, text=True, timeout=120).stdout
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--virtual-time-budget=15000", "--window-size=1200,4000", f"--screenshot={shot}",
                    (tmp_path / "r.html").as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
    charts = re.findall(r'<div class="chart[^"]*" id="([^"]+)"', dom)
    assert set(charts) >= {"timeline", "loss", "metric-acc", "steps", "rate", "load", "rate-time",
                           "load-time-cpu"}, charts
    for i, cid in enumerate(charts):
        start = dom.index(f'id="{cid}"')
        end = dom.index(f'id="{charts[i + 1]}"') if i + 1 < len(charts) else len(dom)
        part = dom[start:end]
        assert "main-svg" in part and part.count('class="point"') >= 1, cid
    # rank 3 lagged: the steps chart's bar for it is the straggler's colour; the failure and its tail
    assert re.search(r"lagging: \d+ steps, the others 40", page), "rank 3 not marked"
    assert "something broke on rank 2" in page and "First failure" in page
