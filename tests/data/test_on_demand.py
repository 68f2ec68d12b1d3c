"""The on-demand synthetic population equals the stored one, user for user and row for row."""

from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedprivacy.config import ConfigError, build_config
from fedprivacy.data import on_demand
from fedprivacy.data.on_demand import OnDemandPopulation, OnDemandTags, TagRows, count_files
from fedprivacy.data.prepared import prepared_tags
from fedprivacy.data.sources import open_source
from fedprivacy.data.stackoverflow import read_tag_counts, read_word_counts
from fedprivacy.data.synthetic import (DEFAULT_MAX_EXAMPLES, TFF_MEAN_EXAMPLES, TFF_MIN_EXAMPLES, _sample, _world,
                                       generate)
from fedprivacy.data.tag_prediction import FederatedTagData, assemble, load_tag_prediction
from fedprivacy.experiments.heldout import _heldout_task
from fedprivacy.stackoverflow_tasks import data_provenance, ensure_data, load_task

CLIENTS, SEED = 300, 4
VOCAB, TAGS = 3000, 60


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """300 train users at TFF's sizes, stored (the reference)."""
    out = tmp_path_factory.mktemp("stored")
    generate(out, num_clients=CLIENTS, seed=SEED)
    return out


def _population(num_clients: int = CLIENTS) -> OnDemandPopulation:
    return OnDemandPopulation(num_clients, SEED, TFF_MIN_EXAMPLES, TFF_MEAN_EXAMPLES, DEFAULT_MAX_EXAMPLES)


def _config(tmp_path: Path, *overrides: str, source: str = "synthetic", path: Path | None = None):
    tree = {"output_dir": str(tmp_path / "run"), "rounds": 2, "eval_every": 1,
            "data": {"path": str(path or tmp_path / "data"), "source": source, "synthetic_clients": CLIENTS,
                     "synthetic_seed": SEED, "vocab_size": VOCAB, "num_tags": TAGS, "max_test_examples": 4000,
                     "generate_if_missing": False},
            "client": {"epochs": 1, "batch_size": 50, "lr": 5.0},
            "processes": 1,
            "privacy": {"clip_norm": 1.0, "noise_multiplier": 0.5, "expected_cohort": 8,
                        "accountants": ["rdp"]}}
    return build_config(tree, list(overrides))


def _same(a: FederatedTagData, b: FederatedTagData) -> None:
    for name in ("features", "tags"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.dtype == y.dtype
        assert np.array_equal(x.indptr, y.indptr) and np.array_equal(x.indices, y.indices)
        assert np.array_equal(x.data, y.data)
    assert a.labels.dtype == b.labels.dtype and np.array_equal(a.labels, b.labels)
    assert np.array_equal(a.offsets, b.offsets) and a.client_ids == b.client_ids
    assert a.num_dropped == b.num_dropped


def test_count_files_of_a_small_population_are_the_stored_ones(stored, tmp_path) -> None:
    words, tags = count_files(_population(), tmp_path)
    assert filecmp.cmp(words, stored / "stackoverflow.word_count", shallow=False)
    assert filecmp.cmp(tags, stored / "stackoverflow.tag_count", shallow=False)
    mtime = words.stat().st_mtime_ns
    assert count_files(_population(), tmp_path) == (words, tags) and words.stat().st_mtime_ns == mtime  # reused


@pytest.mark.parametrize("no_tag", ["label0", "drop"])
@pytest.mark.parametrize("split", ["train", "heldout", "test"])
def test_rows_equal_the_stored_files_preprocessed(stored, split, no_tag) -> None:
    source = open_source("tff-sqlite", stored)
    reference = load_tag_prediction(source, source.word_count, source.tag_count, split, vocab_size=VOCAB,
                                    num_tags=TAGS, no_tag=no_tag)  # always decoded from the files
    rows = TagRows(SEED, source.word_count, source.tag_count, vocab_size=VOCAB, num_tags=TAGS, no_tag=no_tag)
    users = OnDemandTags(_population(), rows, num_clients=CLIENTS)
    if split == "train":
        population = users.population
        _same(assemble([(population.client_id(population.train_user(i)),
                         rows.rows(population.draws(population.train_user(i))[0][1])) for i in range(CLIENTS)],
                       VOCAB, TAGS), reference)
        for i in (0, 17, CLIENTS - 1):
            lo, hi = reference.offsets[i], reference.offsets[i + 1]
            client = users.client(i)
            assert (client.features != reference.features[lo:hi]).nnz == 0
            assert np.array_equal(client.labels, reference.labels[lo:hi])
    else:
        _same(users.split(split), reference)
    if no_tag == "drop":
        assert reference.num_dropped > 0


def test_a_user_is_the_same_whenever_and_however_generated(stored) -> None:
    source = open_source("tff-sqlite", stored)
    rows = TagRows(SEED, source.word_count, source.tag_count, vocab_size=VOCAB, num_tags=TAGS, no_tag="label0")
    first = OnDemandTags(_population(), rows, num_clients=CLIENTS).client(41)
    later = OnDemandTags(_population(), rows, num_clients=CLIENTS)
    for i in (3, 200, 41, 7):
        later.client(i)
    _same(later.client(41), first)
    _same(OnDemandTags(_population(10 * CLIENTS), rows, num_clients=10 * CLIENTS).client(41), first)  # any size


def test_the_task_equals_the_stored_task(stored, tmp_path) -> None:
    for task_name in ("tag", "tag_multilabel"):
        on = load_task(_config(tmp_path, f"data.task={task_name}", "data.max_examples_per_client=150",
                               "data.public_clients=3").data)
        ref = load_task(_config(tmp_path, f"data.task={task_name}", "data.max_examples_per_client=150",
                                "data.public_clients=3", source="tff-sqlite", path=stored).data)
        assert on.population == ref.population == CLIENTS
        for i in range(0, CLIENTS, 23):
            (x, y), (x_ref, y_ref) = on.client_data(i), ref.client_data(i)
            assert x.dtype == x_ref.dtype == np.float32 and (x != x_ref).nnz == 0
            assert isinstance(y, np.ndarray) == isinstance(y_ref, np.ndarray) and y.dtype == y_ref.dtype
            assert (np.array_equal(y, y_ref) if isinstance(y, np.ndarray) else (y != y_ref).nnz == 0)
        assert (on.test_features != ref.test_features).nnz == 0 and on.test_features.shape[0] == 4000
        assert on.public.features.shape == ref.public.features.shape
        # The count-file baselines equal the stored ones computed from the rows (without the per-client cap).
        full = load_task(_config(tmp_path, f"data.task={task_name}", source="tff-sqlite", path=stored).data)
        assert on.majority_baseline == full.majority_baseline


def test_heldout_selection_users_equal_the_stored_ones(stored, tmp_path) -> None:
    cfg = _config(tmp_path, "data.task=tag_multilabel")
    ref = _config(tmp_path, "data.task=tag_multilabel", source="tff-sqlite", path=stored)
    on, st_task = _heldout_task(cfg, 5), _heldout_task(ref, 5)
    assert (on.test_features != st_task.test_features).nnz == 0 and (on.test_labels != st_task.test_labels).nnz == 0
    with pytest.raises(ConfigError, match="selection.heldout_clients"):
        _heldout_task(cfg, None)


def test_a_population_beyond_the_count_sample_matches_the_stored_statistics(stored, tmp_path,
                                                                          monkeypatch) -> None:
    monkeypatch.setattr(on_demand, "COUNT_SAMPLE_USERS", 100)     # 100 of the 300 users counted
    words, tags = count_files(_population(), tmp_path)
    assert "users100" in words.parent.name
    full, part = read_word_counts(stored / "stackoverflow.word_count"), read_word_counts(words)
    full_words, sample_words = list(full), list(part)
    assert set(full_words[:20]) == set(sample_words[:20])
    assert len(set(full_words[:100]) & set(sample_words[:100])) >= 90
    assert len(set(full_words[:1000]) & set(sample_words[:1000])) >= 880
    full_tags, sample_tags = list(read_tag_counts(stored / "stackoverflow.tag_count")), list(read_tag_counts(tags))
    # Users favour a few tags (non-IID), so 100 users rank the tags more noisily than the words.
    assert len(set(full_tags[:10]) & set(sample_tags[:10])) >= 7
    assert len(set(full_tags[:20]) & set(sample_tags[:20])) >= 14
    # Relative frequencies of the top words agree within sampling noise.
    f_total, p_total = sum(full.values()), sum(part.values())
    for w in full_words[:20]:
        assert abs(part[w] / p_total - full[w] / f_total) < 0.1 * full[w] / f_total
    # User sizes: the on-demand users' train sizes are those of the stored users at any population size.
    population = _population(342_477)
    sizes = [len(population.draws(population.train_user(i))[0][1].post_of) for i in range(CLIENTS)]
    stored_sizes = np.diff(prepared_tags(open_source("tff-sqlite", stored), "train", vocab_size=10, num_tags=5,
                                         no_tag="label0")[0].offsets)
    assert sizes == stored_sizes.tolist() and np.mean(sizes) > 300


@pytest.mark.parametrize("override, field", [
    ("data.task=next_word", "data.task"), ("data.view=adadps", "data.view"),
    ("data.client_sample=10", "data.client_sample"), ("data.max_test_examples=null", "data.max_test_examples")])
def test_options_without_meaning_on_demand_are_refused_naming_the_field(tmp_path, override, field) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        _config(tmp_path, override)


def test_a_count_file_the_generator_cannot_have_written_is_refused(tmp_path) -> None:
    (tmp_path / "w").write_text("the 5\nqqqxyz 3\n")
    (tmp_path / "t").write_text('{"python": 2}')
    with pytest.raises(ValueError, match="qqqxyz"):
        TagRows(SEED, tmp_path / "w", tmp_path / "t", vocab_size=10, num_tags=5, no_tag="label0")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(0.0, 1.0, exclude_max=True),
                          st.integers(0, (1 << 18) - 1).map(lambda k: k / (1 << 18)),
                          st.integers(0, 49_999).map(lambda r: float(_world(0).word_cdf.cdf[r])),
                          st.integers(0, 49_999).map(lambda r: float(np.nextafter(_world(0).word_cdf.cdf[r], 0))),
                          st.sampled_from(["tag_cdf", "area_cdf", "api_cdf"]).flatmap(
                              lambda name: st.sampled_from(getattr(_world(0), name).cdf[:-1].tolist())).flatmap(
                              lambda c: st.sampled_from([c, float(np.nextafter(c, 0))]))),
                min_size=1, max_size=50).map(np.array))
def test_the_guide_table_draws_the_indices_of_searchsorted(uniforms) -> None:
    uniforms = uniforms[uniforms < 1.0]
    world = _world(0)
    for guided in (world.word_cdf, world.title_cdf, world.tag_cdf, world.area_cdf, world.api_cdf):
        assert np.array_equal(guided(uniforms), _sample(guided.cdf[:-1], uniforms))


def test_a_run_on_the_real_sized_population(tmp_path, monkeypatch) -> None:
    from fedprivacy.run import run

    monkeypatch.setattr(on_demand, "COUNT_SAMPLE_USERS", 200)     # the vocabulary from 200 users: a fast test
    cfg = _config(tmp_path, "data.synthetic_clients=342477", "data.task=tag_multilabel",
                  "data.max_test_examples=500")
    ensure_data(cfg.data)
    summary = run(cfg)
    assert summary["population"] == 342_477 and summary["rounds_completed"] == 2
    provenance = data_provenance(cfg.data)
    assert provenance["source"] == "synthetic on demand" and provenance["generator"]["num_clients"] == 342_477
    assert not list((tmp_path / "data").rglob("*.sqlite"))


# -- the files the generator wrote: preprocessed from its draws, not decoded ------------------------------
@pytest.mark.parametrize("fmt", ["tff-sqlite", "tff-h5"])
def test_files_the_generator_wrote_are_preprocessed_from_its_draws_to_the_same_rows(tmp_path, fmt, monkeypatch):
    generate(tmp_path, num_clients=40, seed=SEED, format=fmt)
    source = open_source(fmt, tmp_path)
    assert on_demand.generated_population(source) == OnDemandPopulation(40, SEED, TFF_MIN_EXAMPLES, TFF_MEAN_EXAMPLES,
                                                                        DEFAULT_MAX_EXAMPLES)
    for split in ("train", "heldout", "test"):
        for cache in (None, tmp_path / "cache"):
            drawn, _ = prepared_tags(source, split, vocab_size=VOCAB, num_tags=TAGS, no_tag="drop", cache_root=cache,
                                     first=7 if split == "train" else None)
            _same(drawn, load_tag_prediction(source, source.word_count, source.tag_count, split, vocab_size=VOCAB,
                                             num_tags=TAGS, no_tag="drop", max_clients=7 if split == "train" else None))
    decoded = []
    monkeypatch.setattr("fedprivacy.data.prepared.iter_tag_rows", lambda *a, **k: decoded.append(1) or iter(()))
    prepared_tags(source, "train", vocab_size=VOCAB, num_tags=TAGS, no_tag="label0")
    assert not decoded  # nothing decoded but the marker's check of the first client


def test_changed_files_or_a_lying_marker_are_decoded(tmp_path):
    import json
    import os

    generate(tmp_path, num_clients=20, seed=SEED)
    source = open_source("tff-sqlite", tmp_path)
    marker = tmp_path / "synthetic.json"
    honest = json.loads(marker.read_text())
    assert on_demand.generated_population(source) is not None
    for lie in ({"seed": SEED + 1}, {"mean_examples": 300.0}, {"format": "tff-h5"}, {"files": None},
                {"files": {}}, {"num_clients": "many"}):
        marker.write_text(json.dumps({**honest, **lie}))
        assert on_demand.generated_population(source) is None, lie
    marker.write_text(json.dumps({k: v for k, v in honest.items() if k != "files"}))  # an older marker
    assert on_demand.generated_population(source) is None
    marker.write_text(json.dumps(honest))
    stat = (tmp_path / "stackoverflow.sqlite").stat()
    os.utime(tmp_path / "stackoverflow.sqlite", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched
    assert on_demand.generated_population(source) is None


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(["generator", "num_clients", "seed", "format", "min_examples",
                                        "mean_examples", "max_examples", "files"]),
                       st.one_of(st.none(), st.integers(-5, 10**6), st.floats(allow_nan=True), st.text(max_size=5),
                                 st.dictionaries(st.text(max_size=8), st.integers()))))
def test_a_crafted_marker_is_never_trusted_and_never_crashes(tmp_path_factory, marker):
    import json

    folder = tmp_path_factory.mktemp("crafted")
    (folder / "stackoverflow.word_count").write_text("a 1\n")
    (folder / "stackoverflow.tag_count").write_text("{}")
    (folder / "stackoverflow.sqlite").write_bytes(b"")
    (folder / "synthetic.json").write_text(json.dumps(marker))
    assert on_demand.generated_population(open_source("tff-sqlite", folder)) is None
