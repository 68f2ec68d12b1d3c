"""The vectorized on-demand path draws the same users and rows as the straightforward code it replaced.

A synthetic user is a pure function of ``(seed, user)``: its generator's stream, consumed in a fixed order, defines
it. The reference below is the former code, a call per draw in that order (kept here as the specification of the
stream); the library's path must equal it field for field, dtype included, for any seed and user, and its rows
must equal the former row building. A digest of users at three seeds, taken with the former code, pins the stream
independently of both.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedprivacy.data.on_demand import OnDemandPopulation, TagRows, _counted, _expand
from fedprivacy.data.synthetic import (_DATES, _SENTENCES_PER_POST, _TAGS_PER_POST, _TEST_SHARE_BETA,
                                       _TEST_USER_SHARE, _TOKENS_CAP, _TOKENS_MEDIAN, _TOKENS_SIGMA, _TOPIC_SHARE,
                                       DEFAULT_MAX_EXAMPLES, NUM_TAGS, TFF_MEAN_EXAMPLES, TFF_MIN_EXAMPLES,
                                       _Draws, _sample, _sizes, _user_draws, _world)
from fedprivacy.data.tag_prediction import _ClientRows

FIELDS = ("post_of", "times", "answer", "score", "tag_ids", "tag_offsets", "sentence_len", "title_len", "tokens",
          "title")
ROW_FIELDS = ("row_nnz", "columns", "values", "labels", "tag_nnz", "tag_columns")


def _former_words(rng, world, background, post, shares, post_tags, tag_offsets):
    ids = _sample(background.cdf[:-1], rng.random(len(post)))
    u = rng.random(len(post))
    for kind, (low, high) in (("area", (0.0, shares[0])), ("api", (shares[0], shares[0] + shares[1]))):
        topical = np.flatnonzero((u >= low) & (u < high))
        owner = post[topical]
        n_tags = tag_offsets[owner + 1] - tag_offsets[owner]
        tag = post_tags[tag_offsets[owner] + (rng.random(len(owner)) * n_tags).astype(np.int64)]
        table, topic_cdf = ((world.area_words, world.area_cdf) if kind == "area"
                            else (world.api_words, world.api_cdf))
        ids[topical] = table[tag, _sample(topic_cdf.cdf[:-1], rng.random(len(owner)))]
    return ids


def _former_block(rng, world, favourites, n, time_range, p_answer) -> _Draws:
    num_posts = int(n / (1 + _SENTENCES_PER_POST)) + 1
    while True:
        per_post = 1 + rng.poisson(_SENTENCES_PER_POST, num_posts)
        ends = np.cumsum(per_post)
        if ends[-1] >= n:
            break
        num_posts *= 2
    num_posts = int(np.searchsorted(ends, n)) + 1
    per_post = per_post[:num_posts]
    per_post[-1] -= ends[num_posts - 1] - n
    post_of = np.repeat(np.arange(num_posts), per_post)
    times = np.sort(rng.integers(*time_range, size=num_posts))
    answer = rng.random(num_posts) < p_answer
    score = (np.floor(rng.lognormal(0.0, 1.2, num_posts)).astype(np.int64) - rng.binomial(1, 0.1, num_posts))
    n_tags = _sample(_TAGS_PER_POST, rng.random(num_posts)) + 1
    owner = np.repeat(np.arange(num_posts), n_tags)
    first = np.r_[0, np.cumsum(n_tags)[:-1]]
    p_fav = np.full(len(owner), 0.25)
    p_fav[first] = 0.75
    tag_ids = np.where(rng.random(len(owner)) < p_fav, favourites[rng.integers(len(favourites), size=len(owner))],
                       _sample(world.tag_cdf.cdf[:-1], rng.random(len(owner))))
    _, keep = np.unique(owner * NUM_TAGS + tag_ids, return_index=True)
    keep.sort()
    owner, tag_ids = owner[keep], tag_ids[keep]
    tag_offsets = np.r_[0, np.cumsum(np.bincount(owner, minlength=num_posts))]
    sentence_len = np.clip(np.rint(rng.lognormal(np.log(_TOKENS_MEDIAN), _TOKENS_SIGMA, n)),
                           1, _TOKENS_CAP).astype(np.int64)
    title_len = rng.integers(5, 13, size=num_posts)
    tokens = _former_words(rng, world, world.word_cdf, np.repeat(post_of, sentence_len), _TOPIC_SHARE["tokens"],
                           tag_ids, tag_offsets)
    title = _former_words(rng, world, world.title_cdf, np.repeat(np.arange(num_posts), title_len),
                          _TOPIC_SHARE["title"], tag_ids, tag_offsets)
    return _Draws(post_of, times, answer, score, tag_ids, tag_offsets, sentence_len, title_len, tokens, title)


def _former_user(seed, user, world, sizes) -> list[tuple[str, _Draws]]:
    rng = np.random.default_rng([seed, 1, user])
    n_favourites = 1 + min(int(rng.poisson(1.2)), 4)
    favourites = np.unique(_sample(world.tag_cdf.cdf[:-1], rng.random(n_favourites)))
    p_answer = rng.beta(2.0, 1.5)
    start = int(rng.integers(_DATES["start"], _DATES["last_start"]))
    n = sizes.draw(rng)
    in_test = rng.random() < _TEST_USER_SHARE or user == 1
    n_test = max(1, int(rng.binomial(n, rng.beta(*_TEST_SHARE_BETA)))) if in_test else 0
    if user % 10 == 0:
        return [("heldout", _former_block(rng, world, favourites, n + n_test, (start, _DATES["end"]), p_answer))]
    splits = [("train", _former_block(rng, world, favourites, n, (start, _DATES["test"]), p_answer))]
    if n_test:
        splits.append(("test", _former_block(rng, world, favourites, n_test, (_DATES["test"], _DATES["end"]),
                                             p_answer)))
    return splits


def _former_rows(rows: TagRows, draws: _Draws) -> _ClientRows:
    post_of = draws.post_of
    columns = rows.tag_column[draws.tag_ids]
    owner = np.repeat(np.arange(draws.num_posts), np.diff(draws.tag_offsets))
    known = columns >= 0
    order = np.lexsort((columns[known], owner[known]))
    post_columns, post_owner = columns[known][order], owner[known][order]
    post_nnz = np.bincount(post_owner, minlength=draws.num_posts)
    post_start = np.r_[0, np.cumsum(post_nnz)[:-1]]
    post_label = np.zeros(draws.num_posts, dtype=np.int64)
    post_label[post_nnz > 0] = post_columns[post_start[post_nnz > 0]]
    kept = np.flatnonzero(post_nnz[post_of] > 0) if rows.no_tag == "drop" else np.arange(len(post_of))
    posts = post_of[kept]
    n = len(kept)
    sentence_start = np.r_[0, np.cumsum(draws.sentence_len)[:-1]]
    title_start = np.r_[0, np.cumsum(draws.title_len)[:-1]]
    s_len, t_len = draws.sentence_len[kept], draws.title_len[posts]
    token_rows, token_idx = _expand(sentence_start[kept], s_len)
    title_rows, title_idx = _expand(title_start[posts], t_len)
    ids = np.concatenate([rows.word_column[draws.tokens[token_idx]], rows.word_column[draws.title[title_idx]]])
    row = np.concatenate([token_rows, title_rows])
    in_vocab = ids >= 0
    keys, counts = np.unique(row[in_vocab] * rows.vocab_size + ids[in_vocab], return_counts=True)
    key_rows = keys // rows.vocab_size
    lengths = (s_len + t_len).astype(np.float64)
    _, tag_idx = _expand(post_start[posts], post_nnz[posts])
    return _ClientRows(row_nnz=np.bincount(key_rows, minlength=n),
                       columns=(keys % rows.vocab_size).astype(np.int32),
                       values=(counts / lengths[key_rows]).astype(np.float32),
                       labels=post_label[posts].astype(np.int64), tag_nnz=post_nnz[posts].astype(np.int64),
                       tag_columns=post_columns[tag_idx].astype(np.int32), dropped=len(post_of) - n)


def _same_draws(a: _Draws, b: _Draws) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


SIZES = _sizes(TFF_MIN_EXAMPLES, TFF_MEAN_EXAMPLES, DEFAULT_MAX_EXAMPLES)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([0, 3, 2 ** 31 + 5]), st.integers(0, 380_529),
       st.sampled_from([(100, 397, 20_000), (1, 3, 40)]))
def test_a_user_is_drawn_as_the_former_code_drew_it(seed, user, sizes) -> None:
    world, sizes = _world(seed), _sizes(*sizes)
    expected = _former_user(seed, user, world, sizes)
    drawn = _user_draws(seed, user, world, sizes)
    assert [split for split, _ in drawn] == [split for split, _ in expected]
    for (_, a), (_, b) in zip(drawn, expected):
        _same_draws(a, b)
    [(split, first)] = _user_draws(seed, user, world, sizes, first_only=True)
    assert split == expected[0][0]
    _same_draws(first, expected[0][1])


@pytest.fixture(scope="module")
def tag_rows(tmp_path_factory) -> dict[str, TagRows]:
    """Row builders over count files that list the names in a scrambled order (columns unrelated to ranks)."""
    folder = tmp_path_factory.mktemp("counts")
    world, rng = _world(0), np.random.default_rng(5)
    words, tags = folder / "words", folder / "tags"
    words.write_text("".join(f"{w} {len(world.words) - i}\n" for i, w in enumerate(rng.permutation(world.words))))
    tags.write_text(json.dumps({t: len(world.tags) - i for i, t in enumerate(rng.permutation(world.tags).tolist())}))
    return {no_tag: TagRows(0, words, tags, vocab_size=vocab, num_tags=num_tags, no_tag=no_tag)
            for no_tag, vocab, num_tags in (("label0", 10_000, 500), ("drop", 3_000, 40))}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 380_529), st.sampled_from(["label0", "drop"]))
def test_rows_are_built_as_the_former_code_built_them(tag_rows, user, no_tag) -> None:
    rows = tag_rows[no_tag]
    for _, draws in _user_draws(0, user, _world(0), SIZES):
        a, b = rows.rows(draws), _former_rows(rows, draws)
        for name in ROW_FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
        assert a.dropped == b.dropped


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=0, max_size=30).map(sorted), min_size=0, max_size=4))
def test_counting_keys_made_of_ascending_runs_is_unique_with_counts(runs) -> None:
    keys = np.array([k for run in runs for k in run], dtype=np.int64)
    expected = np.unique(keys, return_counts=True)
    got = _counted(keys)
    assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(got, expected))


DIGEST = "6365105cddd5523f406fa52ec8d803ec32eb69e759d84b0d63d2c856b48b2b75"
"""SHA-256 of every 37th user's draws (all splits; dtype and bytes of each field) at seeds 0, 1 and 7 of a
2,000-client population, taken with the former code (at revision 0c74c33)."""


def test_the_stream_is_the_one_the_former_code_drew() -> None:
    digest = hashlib.sha256()
    for seed in (0, 1, 7):
        population = OnDemandPopulation(2000, seed, TFF_MIN_EXAMPLES, TFF_MEAN_EXAMPLES, DEFAULT_MAX_EXAMPLES)
        for user in range(0, population.num_users, 37):
            for split, draws in population.draws(user):
                digest.update(split.encode())
                for name in FIELDS:
                    array = getattr(draws, name)
                    digest.update(str(array.dtype).encode())
                    digest.update(np.ascontiguousarray(array).tobytes())
    assert digest.hexdigest() == DIGEST
