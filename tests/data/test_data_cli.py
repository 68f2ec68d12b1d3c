"""Tests of ``fedprivacy data generate --format`` and ``fedprivacy data stats``."""

from __future__ import annotations

import json
from pathlib import Path

from fedprivacy.cli import main


def test_generate_both_formats_and_stats_agree(tmp_path: Path, capsys) -> None:
    stats = {}
    for fmt in ("tff-sqlite", "tff-h5"):
        out = tmp_path / fmt
        assert main(["data", "generate", "--out", str(out), "--clients", "12", "--seed", "2",
                     "--format", fmt]) == 0
        written = json.loads(capsys.readouterr().out)
        assert all(Path(p).exists() for p in written.values())
        assert len(written) == (3 if fmt == "tff-sqlite" else 5)
        assert main(["data", "stats", "--source", fmt, "--path", str(out)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["source"] == fmt
        stats[fmt] = {split: (s["clients"], s["examples"], s["empty_clients"])
                      for split, s in report["splits"].items()}
    assert stats["tff-sqlite"] == stats["tff-h5"]
    assert stats["tff-sqlite"]["train"][0] == 12 and stats["tff-sqlite"]["train"][1] > 12


def test_stats_on_a_corrupt_file_is_one_clear_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "stackoverflow_train.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00" * 50)
    assert main(["data", "stats", "--source", "tff-h5", "--path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not a readable HDF5 file" in err
    assert main(["data", "stats", "--source", "tff-sqlite", "--path", str(tmp_path / "x")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
