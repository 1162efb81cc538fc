"""The model's types round-trip through JSON losslessly (run.json keeps the cluster as it was)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

from orchestrator import sh
from orchestrator.model import Checks, Cluster, Host, Job, Slurm, SshSettings
from orchestrator.runs import MASK, create_run, load_run


def _jump() -> Host:
    return Host(name="bastion", address="bastion.example", user="hop", port=2222)


def _host(name: str, **kw) -> Host:
    return Host(name=name, address=f"{name}.example", user="train", port=2200, identity_file="/k/id",
                known_hosts="/k/known", connection="ssh", slots=2, devices=(4, 5), device_ips={4: "10.1.0.4"},
                env={"A": "1", "MY_TOKEN": "s3cr3t-value"}, hostname=f"{name}.internal", jump=(_jump(),),
                proxy_command=None, mpi_address=f"192.168.0.{len(name)}", keepalive=15.0, connect_timeout=3.0,
                super_device_ids={4: 100}, super_pod_id=2, spare=True, **kw)


def full_cluster(tmp_path: Path) -> Cluster:
    """Every field of every type set to something other than its default."""
    job = Job(workdir="/data/w", command=("python", "train.py", "--lr", "0.1"), launcher="msrun", platform="ascend",
              env={"X": "y", "API_KEY": "abcdefgh"}, secret_env=("X",), sync=("train.py",), sync_exclude=("*.ckpt",), sync_via="launch-host",
              log_dir="logs", timeout=60.0, on_failure="continue", mpirun_args=("--bind-to", "core"),
              rank_table_version="1.2", master_port=9000, restarts=2, restart_delay=1.5, stall_timeout=30.0,
              interface="eth1", rank_dirs=True, hccl_connect_timeout=600, hccl_exec_timeout=1200,
              metrics={"acc": "acc=([0-9.]+)"}, collect=("checkpoints/*.ckpt",))
    template = Host(name="", address="", user="train", slots=8, devices=tuple(range(8)), proxy_command="nc %h %p",
                    connection="local")
    slurm = Slurm(nodes=2, template=template, partition="p", account="a", qos="q", time="01:00:00", constraint="c",
                  gres="gpu:8", exclusive=True, extra=("--comment=x",), login="login1", conf="/etc/slurm/x.conf",
                  login_host=_host("login1"), spares=1)
    (tmp_path / "cluster.yaml").write_text("name: full\n")
    return Cluster(name="full", path=tmp_path / "cluster.yaml", hosts=(_host("a"), _host("b")), job=job,
                   ssh=SshSettings(connect_timeout=2, command_timeout=30, fanout=8, host_key_policy="accept-new",
                                   retries=1, config_file=None, jump_fanout=3),
                   checks=Checks(versions=("python",), skip=("disk",), min_free_gib=2.0, clock_skew=1.0),
                   groups={"g": ("a", "b")}, slurm=slurm)


def test_the_sample_sets_every_field(tmp_path):
    """A field added to the model must be added here too (and so be round-tripped)."""
    c = full_cluster(tmp_path)
    samples = {Cluster: [c], Job: [c.job], SshSettings: [c.ssh], Checks: [c.checks], Slurm: [c.slurm],
               Host: [*c.hosts, c.slurm.template, c.slurm.login_host]}
    for cls, objs in samples.items():
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default
            assert any(getattr(o, f.name) != default for o in objs), f"{cls.__name__}.{f.name}: only its default"


def test_cluster_round_trips_through_json(tmp_path):
    c = full_cluster(tmp_path)
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_run_record_keeps_the_cluster_with_secrets_masked(tmp_path):
    c = full_cluster(tmp_path)
    back = load_run(create_run(c, {}, cwd=tmp_path).id, cwd=tmp_path).cluster()
    assert back.job.env == {"X": MASK, "API_KEY": MASK}
    assert all(h.env == {"A": "1", "MY_TOKEN": MASK} for h in back.hosts)
    assert back.slurm.login_host.env["MY_TOKEN"] == MASK
    unmask = {**c.job.env}
    restored = Cluster.from_dict({**back.to_dict(), "job": {**back.to_dict()["job"], "env": unmask}})
    hosts = tuple(Host.from_dict({**h.to_dict(), "env": dict(o.env)}) for h, o in zip(back.hosts, c.hosts))
    slurm = Slurm.from_dict({**back.slurm.to_dict(), "login_host": c.slurm.login_host.to_dict()})
    assert Cluster.from_dict({**restored.to_dict(), "hosts": [h.to_dict() for h in hosts],
                              "slurm": slurm.to_dict()}) == c


def test_no_secret_reaches_run_json_whatever_holds_it(tmp_path):
    """Only a Slurm template's or login host's env holds a secret: it is masked in the cluster
    record, in the allocation's record (put in run.data later, as `up` does) and in the file
    mode; a Secret anywhere in run.data is masked when saved."""
    c = full_cluster(tmp_path)
    plain = replace(c, job=replace(c.job, env={"X": "1"}, secret_env=()),
                    hosts=tuple(replace(h, env={"A": "1"}) for h in c.hosts),
                    slurm=replace(c.slurm, template=replace(c.slurm.template, env={"HF_TOKEN": "tmpl-s3cret"}),
                                  login_host=replace(c.slurm.login_host, env={"MY_TOKEN": "login-s3cret"})))
    run = create_run(plain, {}, cwd=tmp_path)
    run.data["slurm"] = {"job_id": "7", "login_host": plain.slurm.login_host.to_dict()}  # Allocation.record()
    run.data["extra"] = [{"deep": sh.Secret("deep-s3cret")}]
    run.save()
    text = (run.dir / "run.json").read_text()
    assert not [s for s in ("tmpl-s3cret", "login-s3cret", "deep-s3cret") if s in text]
    assert text.count(MASK) == 4 and (run.dir / "run.json").stat().st_mode & 0o077 == 0


def test_commands_that_read_a_record_do_not_import_pydantic():
    """orch status/logs/down work from run.json: the validation layer (pydantic) stays unloaded."""
    code = ("import sys, orchestrator.runs, orchestrator.lifecycle, orchestrator.runlogs, orchestrator.runstate;"
            "print('pydantic' in sys.modules, 'orchestrator.spec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"], out


def test_the_file_shape_and_the_model_name_the_same_fields():
    """spec.Raw* (the YAML's shape, pydantic) and model.* (frozen types) are kept apart on
    purpose; a key added to one must be added to the other, or listed here with the reason."""
    from orchestrator import model, spec

    derived = {  # model fields that no YAML key of the same name gives
        model.Slurm: {"template", "login_host"},  # the inventory's defaults; `login` as SSH reaches it
        model.Job: {"rank_table_version", "hccl_connect_timeout", "hccl_exec_timeout"},  # rank_table:, hccl:
        model.Host: {"connect_timeout", "keepalive", "hostname", "proxy_command"},  # ssh: and ~/.ssh/config
    }
    nested = {spec.RawJob: {"rank_table", "hccl"}}  # YAML mappings flattened into model fields
    for raw, typ in ((spec.RawSlurm, model.Slurm), (spec.RawSsh, model.SshSettings), (spec.RawChecks, model.Checks),
                     (spec.RawJob, model.Job), (spec.RawHost, model.Host)):
        assert set(raw.model_fields) - nested.get(raw, set()) == \
            {f.name for f in fields(typ)} - derived.get(typ, set()), typ.__name__


def test_a_run_takes_the_id_chosen_for_it_and_a_new_one_when_that_is_taken(tmp_path):
    """`orch up` chooses the id before its preflight (a member's check may stay to be its
    supervisor, which is found by that id); taken meanwhile, the run gets another, and `orch up`
    closes what held sessions for the first (api._up_on)."""
    c = full_cluster(tmp_path)
    assert create_run(c, {}, cwd=tmp_path, run_id="20261128-000000-abcdef").id == "20261128-000000-abcdef"
    other = create_run(c, {}, cwd=tmp_path, run_id="20261128-000000-abcdef").id
    assert other != "20261128-000000-abcdef" and len(other) == len("20261128-000000-abcdef")
