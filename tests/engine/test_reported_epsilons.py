"""``fedprivacy run`` computes every accountant's epsilon at the evaluated rounds only (every ``eval_every``-th and
the last) and the budget accountant's at every round: the values it reports are those of a run that computes all
of them every round, the budget stops the run at the same round, and the summary of a run stopped after an
unevaluated round holds every accountant's epsilon of its whole ledger."""

import math

import pandas as pd

from fedprivacy.privacy.accounting import epsilon_for
from fedprivacy.run import run

SMALL = ("data.vocab_size=50", "data.num_tags=5", "rounds=8", "privacy.target_epsilon=6.5")
# 40 users, cohort 8, z = 0.5, delta 1/40: RDP epsilon 6.21 after 4 rounds, 6.86 after 5: round 5 is never run


def _run(small_config, tmp_path, eval_every: int) -> tuple[dict, pd.DataFrame]:
    folder = tmp_path / f"every{eval_every}"
    summary = run(small_config(*SMALL, f"eval_every={eval_every}", f"output_dir={folder}"))
    return summary, pd.read_csv(folder / "metrics.csv")


def test_the_budget_stops_at_the_same_round_and_every_reported_epsilon_is_unchanged(small_config, tmp_path):
    every_round, rows_all = _run(small_config, tmp_path, 1)  # every accountant at every round, as before
    evaluated, rows = _run(small_config, tmp_path, 3)
    assert every_round["stop_reason"] == evaluated["stop_reason"] == "privacy_budget"
    assert every_round["rounds_completed"] == evaluated["rounds_completed"] == 4
    assert epsilon_for("poisson", 8 / 40, 0.5, 4, 1 / 40, "rdp", population=40) < 6.5 \
        < epsilon_for("poisson", 8 / 40, 0.5, 5, 1 / 40, "rdp", population=40)
    assert rows["epsilon_rdp"].tolist() == rows_all["epsilon_rdp"].tolist()  # the budget's: every round
    assert rows.loc[rows["round"] == 3, "epsilon_pld"].tolist() == rows_all.loc[rows_all["round"] == 3,
                                                                                "epsilon_pld"].tolist()
    assert rows.loc[rows["round"] != 3, "epsilon_pld"].isna().all() and rows_all["epsilon_pld"].notna().all()
    for kind in ("rdp", "pld"):  # round 4 was not evaluated: the summary computes its pld epsilon
        assert evaluated[f"epsilon_{kind}"] == every_round[f"epsilon_{kind}"] > 0
        assert not math.isnan(evaluated[f"epsilon_{kind}"])
