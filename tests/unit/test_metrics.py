"""Progress read from rank output (orchestrator/agent/metrics.py): the built-in formats,
job.metrics, hostile bytes, bounded memory, the wire and the head's merge."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.agent import metrics, protocol
from orchestrator.agent.metrics import MAX_LINE, READ_BUDGET, Progress
from orchestrator.errors import SpecError
from tests.unit.test_spec import problems, write


def fed(text: bytes, user=None, now=100.0) -> metrics.RankProgress:
    pr = Progress(user)
    p = metrics.RankProgress(0)
    pr.feed(p, text, now)
    return p


def test_mindspore_lines_give_epoch_step_loss_and_steps_over_epochs():
    p = fed(b"".join(b"epoch: %d, step: %d, loss is %.4f\n" % (e, s, 2.0 / (e * 10 + s))
                     for e in (1, 2) for s in range(1, 6)))
    assert (p.epoch, p.step, p.loss) == (2, 5, pytest.approx(2.0 / 25, abs=1e-4))
    assert p.records == 10 and p.total == 10    # the counter restarts each epoch; total does not


def test_mindspore_variants_tensor_loss_and_time_monitor():
    p = fed(b"epoch: 3 step: 1875, loss is Tensor(shape=[], dtype=Float32, value= 0.1234)\n"
            b"Train epoch time: 5432.1 ms, per step time: 2.897 ms\n")
    assert (p.epoch, p.step, p.loss) == (3, 1875, 0.1234)
    assert p.values == {"epoch_time_ms": 5432.1, "step_time_ms": 2.897}


def test_nan_loss_is_kept_as_a_word():
    p = fed(b"epoch: 1, step: 2, loss is nan\n")
    assert p.loss == "nan"
    json.dumps(p.record(100.0), allow_nan=False)    # still valid JSON


def test_hugging_face_trainer_dicts():
    p = fed(b"{'loss': 0.6931, 'grad_norm': 1.25, 'learning_rate': 4.5e-05, 'epoch': 0.5}\n"
            b" 50%|#####     | 5/10 [00:01<00:01,  4.50it/s]\r"
            b"{'loss': 0.5, 'learning_rate': 4e-05, 'epoch': 1.0}\n"
            b"{'eval_loss': 0.41, 'eval_runtime': 1.5, 'epoch': 1.0}\n")
    assert p.loss == 0.5 and p.epoch == 1.0 and p.records == 2
    assert p.values["learning_rate"] == 4e-05 and p.values["grad_norm"] == 1.25 and p.values["eval_loss"] == 0.41


def test_job_metrics_one_group_each_and_loss_overrides():
    p = fed(b"it 7 acc=0.91 lr 0.1\nit 8 acc=0.93 my_loss 1.5\n",
            {"acc": r"acc=([0-9.]+)", "loss": r"my_loss ([0-9.]+)", "step": r"^it (\d+)"})
    assert p.values == {"acc": 0.93} and p.loss == 1.5 and p.step == 8 and p.total == 2


@pytest.mark.parametrize("name, pattern, says", [
    ("acc", r"acc=[0-9.]+", "0 groups"),
    ("acc", r"(acc)=([0-9.]+)", "2 groups"),
    ("acc", r"acc=([0-9.]+", "not a regular expression"),
    ("1acc", r"acc=([0-9.]+)", "name"),
    ("acc", "", "non-empty"),
])
def test_bad_job_metrics_are_refused(name, pattern, says):
    with pytest.raises(metrics.MetricsError, match=says):
        metrics.check_pattern(name, pattern)


def test_bad_job_metrics_in_the_cluster_file_have_file_and_line(tmp_path):
    text = """\
    inventory: {hosts: [{address: node1}]}
    job:
      workdir: /data/x
      command: python t.py
      metrics:
        acc: 'acc=([0-9.]+)'
        top5: 'top5=[0-9.]+'
    """
    probs = problems(tmp_path, text)
    assert any(line == 7 and field == "job.metrics.top5" and "one" in msg for line, field, msg in probs), probs
    assert len(probs) == 1
    from orchestrator.spec import load_cluster
    good = load_cluster(write(tmp_path, text.replace("top5=[0-9.]+", "top5=([0-9.]+)")))
    assert dict(good.job.metrics) == {"acc": "acc=([0-9.]+)", "top5": "top5=([0-9.]+)"}
    with pytest.raises(SpecError):
        load_cluster(write(tmp_path, text.replace("acc: 'acc=([0-9.]+)'", "acc: [1]")))


def test_lines_split_anywhere_give_the_same_figures():
    text = b"".join(b"epoch: 1, step: %d, loss is %d.5\n" % (s, s) for s in range(1, 40))
    whole = fed(text)
    pr = Progress()
    p = metrics.RankProgress(0)
    for i in range(0, len(text), 7):
        pr.feed(p, text[i:i + 7], 100.0)
    assert (p.step, p.loss, p.records, p.total) == (whole.step, whole.loss, whole.records, whole.total) == \
        (39, 39.5, 39, 39)


def test_an_over_long_line_is_skipped_whole_and_memory_stays_bounded():
    pr = Progress()
    p = metrics.RankProgress(0)
    pr.feed(p, b"epoch: 1, step: 1, loss is 9 " + b"x" * (3 * MAX_LINE), 100.0)
    assert len(p.partial) <= MAX_LINE and p.drop
    pr.feed(p, b"y" * MAX_LINE + b" epoch: 1, step: 2, loss is 8\nepoch: 1, step: 3, loss is 7\n", 100.0)
    assert (p.step, p.loss) == (3, 7.0)   # the long line's own progress text was never taken
    assert p.records == 1 and not p.drop and p.partial == b""


def test_a_rank_writing_faster_than_the_budget_has_its_oldest_bytes_skipped(tmp_path):
    log = tmp_path / "stdout"
    line = b"epoch: 1, step: %08d, loss is 1.0\n"
    n = READ_BUDGET // len(line % 0) * 3
    log.write_bytes(b"".join(line % i for i in range(n)))
    pr = Progress()
    pr.reset([0])
    pr.read(0, str(log), log.stat().st_size, 100.0)
    p = pr.ranks[0]
    assert p.step == n - 1 and p.skipped >= 2 * READ_BUDGET - len(line % 0)
    assert p.offset == log.stat().st_size and p.records < n // 2
    with open(log, "ab") as fh:
        fh.write(line % n)
    pr.read(0, str(log), log.stat().st_size, 101.0)
    assert p.step == n and p.out == 101.0


def test_a_truncated_log_is_read_from_its_start(tmp_path):
    log = tmp_path / "stdout"
    log.write_bytes(b"epoch: 1, step: 50, loss is 1\n")
    pr = Progress()
    pr.read(0, str(log), log.stat().st_size, 1.0)
    log.write_bytes(b"epoch: 1, step: 2, loss is 3\n")
    pr.read(0, str(log), log.stat().st_size, 2.0)
    assert (pr.ranks[0].step, pr.ranks[0].loss) == (2, 3.0)


def test_steps_per_second_over_the_window():
    pr = Progress()
    p = metrics.RankProgress(0)
    for t in range(6):
        pr.feed(p, b"epoch: 1, step: %d, loss is 1\n" % (t * 4 + 1), 100.0 + t)
    assert p.rate(105.0) == 4.0
    assert p.rate(105.0 + metrics.RATE_WINDOW + 1) == 0.0     # nothing for a while: stopped


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=3 * MAX_LINE), max_size=12),
       st.sampled_from([None, {"x": r"x=(\d+)"}, {"loss": r"(.)"}]))
def test_any_bytes_in_any_pieces_never_raise_and_stay_bounded(chunks, user):
    pr = Progress(user)
    p = metrics.RankProgress(3)
    for c in chunks:
        pr.feed(p, c, 100.0)
        assert len(p.partial) <= MAX_LINE
    rec = p.record(100.0)
    json.dumps(rec, allow_nan=False)
    assert metrics.parse_progress([rec], protocol.ProtocolError) == [
        {k: v for k, v in rec.items() if k != "values" or v}]


def test_a_report_with_progress_is_checked_field_by_field():
    rep = {"host": "h1", "attempt": 1, "ranks": [], "procs": [], "out": 1.0, "stopping": None, "live": True,
           "progress": [{"rank": 0, "step": 3, "epoch": 1, "loss": 0.5, "total": 3, "records": 3, "rate": 1.0,
                         "out": 1.0, "t_step": 1.0, "values": {"acc": 0.9}}]}
    assert protocol.parse_report(rep)["progress"][0]["values"] == {"acc": 0.9}
    assert protocol.parse_report(dict(rep, progress=None))["progress"] == []
    for bad in ([{"rank": "0"}], [{"rank": 0, "loss": "1"}], [{"rank": 0, "values": {"a b": 1}}],
                [{"rank": 0, "step": float("inf")}], {"0": {}}, [{"rank": 0, "values": {"x%d" % i: 1 for i in range(99)}}]):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_report(dict(rep, progress=bad))


def test_the_head_keeps_each_hosts_progress_for_its_own_ranks_only():
    doc = {"attempt": 1}
    rank_host = {0: "h1", 1: "h2"}
    metrics.merge(doc, rank_host, "h1", [{"rank": 0, "step": 5}, {"rank": 1, "step": 99}])
    assert doc["progress"] == {"0": {"rank": 0, "step": 5}}
    doc["attempt"] = 2
    metrics.merge(doc, rank_host, "h2", [{"rank": 1, "step": 1}])
    assert doc["progress"] == {"1": {"rank": 1, "step": 1}}    # a new attempt's figures only


def test_status_json_carries_each_ranks_figures():
    from orchestrator import runstate
    doc = {"v": 1, "state": "running", "attempt": 1, "ranks": [{"rank": 0, "host": "h1", "state": "running"}],
           "progress": {"0": {"rank": 0, "step": 7, "loss": 0.5}}, "load": {"h1": {"cpu": 99.0}}}
    d = runstate.from_head(doc).to_dict()
    assert d["progress"] == {"0": {"rank": 0, "step": 7, "loss": 0.5}} and d["load"] == {"h1": {"cpu": 99.0}}


def test_a_host_of_many_ranks_with_many_metrics_stays_within_a_frame():
    pr = Progress({f"m{i}": rf"m{i}=(\d+)" for i in range(metrics.MAX_NAMES)})
    line = b" ".join(b"m%d=%d" % (i, i) for i in range(metrics.MAX_NAMES)) + b" epoch: 1, step: 3, loss is 1\n"
    for r in range(512):
        p = pr.ranks[r] = metrics.RankProgress(r)
        p.out = 1.0
        pr.feed(p, line, 1.0)
    rep = {"host": "h", "attempt": 1, "ranks": [], "procs": [], "out": 1.0, "stopping": None, "live": True,
           "progress": pr.report(2.0)}
    assert len(protocol.encode(protocol.report(rep))) < protocol.LINE
    assert rep["progress"][0]["step"] == 3 and "values" not in rep["progress"][0]
