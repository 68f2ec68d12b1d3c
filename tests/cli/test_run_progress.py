"""``fedprivacy run``'s progress (issue 33): round N of T, elapsed, ETA, epsilon, last test accuracy;
plain lines on stderr when not on a terminal, nothing with ``--quiet``; the JSON summary alone on stdout."""

import io
import json
import re

from rich.console import Console

from fedprivacy.cli import main
from fedprivacy.experiments.progress import RunProgress

LINE = re.compile(r"^round (\d+)/(\d+) \| elapsed (\d+:\d\d:\d\d) \| ETA (\d+:\d\d:\d\d) \| "
                  r"eps\(rdp\) (\d+\.\d{3}), test accuracy (-|\d\.\d{4})$")


def _lines(every_s: float, rounds: range, total: int = 10) -> list[str]:
    out = io.StringIO()
    now = [100.0]
    progress = RunProgress(total, "rdp", console=Console(file=out), every_s=every_s, clock=lambda: now[0])
    assert progress.mode == "lines"  # not a terminal
    with progress:
        for r in rounds:
            now[0] += 3.0  # 3 s per round
            progress.round_done(r, {"epsilon_rdp": 0.5 * r, **({"test_accuracy": 0.01 * r} if r % 5 == 0 else {})})
    return out.getvalue().splitlines()


def test_plain_lines_show_n_of_t_elapsed_eta_epsilon_and_the_last_accuracy():
    lines = _lines(every_s=0.0, rounds=range(1, 11))
    assert len(lines) == 10 and all(LINE.match(line) for line in lines), lines
    assert lines[1] == "round 2/10 | elapsed 0:00:06 | ETA 0:00:24 | eps(rdp) 1.000, test accuracy -"
    assert lines[6] == "round 7/10 | elapsed 0:00:21 | ETA 0:00:09 | eps(rdp) 3.500, test accuracy 0.0500"
    assert lines[-1].startswith("round 10/10 | elapsed 0:00:30 | ETA 0:00:00 |")


def test_plain_lines_come_at_most_every_every_s_plus_the_first_and_last_round():
    lines = _lines(every_s=10.0, rounds=range(1, 11))
    assert [int(LINE.match(line).group(1)) for line in lines] == [1, 5, 9, 10]


def test_a_resumed_runs_eta_counts_only_the_rounds_of_this_process():
    lines = _lines(every_s=0.0, rounds=range(7, 11))
    assert lines[0] == "round 7/10 | elapsed 0:00:03 | ETA 0:00:09 | eps(rdp) 3.500, test accuracy -"


def _run(small_data, tmp_path, *extra: str) -> list[str]:
    sets = [f"data.path={small_data}", "data.generate_if_missing=false", "data.vocab_size=2000", "data.num_tags=50",
            "rounds=3", "eval_every=2", f"output_dir={tmp_path / 'run'}", "client.epochs=1",
            "privacy.expected_cohort=8", "privacy.accountants=[rdp]"]
    return ["run", *(f"--set={s}" for s in sets), *extra]


def test_run_prints_progress_lines_on_stderr_and_only_the_summary_on_stdout(small_data, tmp_path, capsys):
    assert main(_run(small_data, tmp_path)) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)  # stdout is exactly the JSON summary
    assert summary["rounds_completed"] == 3
    progress = [line for line in err.splitlines() if LINE.match(line)]
    assert [LINE.match(line).group(1, 2) for line in progress] == [("1", "3"), ("3", "3")]
    assert progress[-1].endswith(f"eps(rdp) {summary['epsilon_rdp']:.3f}, test accuracy {summary['test_accuracy']:.4f}")


def test_quiet_prints_no_progress_and_no_round_log(small_data, tmp_path, capsys):
    assert main(_run(small_data, tmp_path, "--quiet")) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rounds_completed"] == 3
    assert "ETA" not in err and not any(LINE.match(line) for line in err.splitlines())
