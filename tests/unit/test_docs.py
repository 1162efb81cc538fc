"""The repository's own docs stand alone and are complete: every key the loader accepts and
every command flag is in docs/reference.md, and every relative link in README.md and docs/
points at a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from orchestrator import spec
from orchestrator.cli import cli

REPO = Path(__file__).resolve().parents[2]
REFERENCE = (REPO / "docs" / "reference.md").read_text()
MODELS = [spec.RawCluster, spec.RawSsh, spec.RawJob, spec.RawRankTable, spec.RawHccl, spec.RawChecks,
          spec.RawInventory, spec.RawHostKeys, spec.RawHost, spec.RawSlurm]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_key_is_in_the_reference(model):
    missing = [k for k in model.model_fields if f"`{k}`" not in REFERENCE]
    assert not missing, f"{model.__name__}: {missing} not documented in docs/reference.md"


def _commands():
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        cmd = cli.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                yield f"{name} {sub}", cmd.get_command(ctx, sub)
        else:
            yield name, cmd


def test_every_command_and_flag_is_in_the_reference():
    missing = []
    for name, cmd in _commands():
        if f"orch {name}" not in REFERENCE:
            missing.append(f"orch {name}")
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                if not any(f"`{o}" in REFERENCE or f"{o}`" in REFERENCE or f"{o} " in REFERENCE for o in p.opts):
                    missing.append(f"orch {name} {p.opts[0]}")
    assert not missing, f"not in docs/reference.md: {missing}"


def _links(path: Path):
    for m in re.finditer(r"\]\(([^)#\s]+)(#[^)]*)?\)", path.read_text()):
        yield m.group(1)


def test_links_point_inside_the_repository():
    bad = []
    for doc in [REPO / "README.md", REPO / "playbooks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        if "../shared" in text or "CONTRACT.md" in text or "FORMATS.md" in text:
            bad.append(f"{doc.relative_to(REPO)}: refers to files outside the repository")
        for link in _links(doc):
            if re.match(r"^[a-z]+://", link):
                continue
            target = (doc.parent / link).resolve()
            if REPO not in target.parents and target != REPO or not target.exists():
                bad.append(f"{doc.relative_to(REPO)}: {link}")
    assert not bad, bad
