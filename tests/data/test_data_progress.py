"""Progress of data work: a bar advancing to its total on a terminal, nothing on anything else."""

import io
import re

import pytest
from rich.console import Console

from fedprivacy.data import progress
from fedprivacy.data.prepared import prepared_tags, prepared_tokens
from fedprivacy.data.sources import open_source
from fedprivacy.data.synthetic import generate


def terminal() -> tuple[Console, io.StringIO]:
    screen = io.StringIO()
    return Console(file=screen, force_terminal=True, width=120), screen


def counts(text: str) -> list[tuple[int, int]]:
    """Every ``done/total`` the bar rendered, in order."""
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) ", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text))]


def test_the_bar_advances_with_the_items_to_the_total_and_stops_with_the_consumer():
    console, screen = terminal()
    assert list(progress.with_progress(range(7), 7, "reading", "items", console)) == list(range(7))
    assert counts(screen.getvalue())[-1] == (7, 7)
    console, screen = terminal()
    for i in progress.with_progress(range(7), 7, "reading", "items", console):
        if i == 2:
            break
    assert counts(screen.getvalue())[-1] == (2, 7)  # the consumer stopped after 3 items: 2 fully consumed


def test_generating_data_shows_every_user_on_a_terminal_and_nothing_elsewhere(tmp_path):
    console, screen = terminal()
    generate(tmp_path / "a", num_clients=9, seed=1, min_examples=1, mean_examples=5, max_examples=20, console=console)
    assert counts(screen.getvalue())[-1] == (10, 10)  # 9 train users and 1 held-out user
    plain = io.StringIO()
    generate(tmp_path / "b", num_clients=9, seed=1, min_examples=1, mean_examples=5, max_examples=20,
             console=Console(file=plain))
    assert plain.getvalue() == ""


@pytest.mark.parametrize("task", ["tag", "next_word"])
def test_building_the_cache_shows_every_user_once_and_a_cache_hit_nothing(small_data, tmp_path, monkeypatch, task):
    console, screen = terminal()
    monkeypatch.setattr(progress, "stderr_console", lambda: console)
    source = open_source("tff-sqlite", small_data)
    users = len(source.client_ids("train"))

    def load():
        if task == "tag":
            return prepared_tags(source, "train", vocab_size=100, num_tags=10, no_tag="label0", cache_root=tmp_path)
        return prepared_tokens(source, "train", vocab_size=100, seq_len=5, cache_root=tmp_path)

    assert load()[1] == "built"
    assert counts(screen.getvalue())[-1] == (users, users)
    screen.truncate(0)
    assert load()[1] == "hit" and screen.getvalue() == ""
    plain = io.StringIO()
    monkeypatch.setattr(progress, "stderr_console", lambda: Console(file=plain))
    prepared_tags(source, "train", vocab_size=101, num_tags=10, no_tag="label0", cache_root=tmp_path)
    assert plain.getvalue() == ""
