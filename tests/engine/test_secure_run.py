"""Secure aggregation with distributed Skellam noise in a run (issue "Secure aggregation", items 1, 2, 4)."""

import csv

import numpy as np
import pytest
import torch

from fedprivacy.run import run

SECAGG = ("privacy.placement=distributed", "privacy.secure_aggregation.threshold=3",
          "privacy.secure_aggregation.neighbours=5", "privacy.accountants=[rdp]")


def test_a_secure_run_releases_and_accounts_skellam_rounds(small_config):
    cfg = small_config("rounds=2", *SECAGG)
    summary = run(cfg)
    with open(cfg.output_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    print(rows)
    assert summary["releases"] == 2
