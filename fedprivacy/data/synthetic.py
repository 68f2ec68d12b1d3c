"""Synthetic StackOverflow data in TensorFlow Federated's on-disk format.

:func:`generate` writes the three files TFF ships for StackOverflow, with the
same layouts, so every reader works unchanged on real and synthetic data:

* ``stackoverflow.sqlite``: tables ``examples(split_name, client_id,
  serialized_example_proto)`` and ``client_metadata(client_id, split_name,
  num_examples)``; splits ``train``, ``heldout`` and ``test``; each row a
  serialized ``tf.train.Example`` with the six real features.
* ``stackoverflow.word_count``: ``word count`` lines, most frequent first.
* ``stackoverflow.tag_count``: a JSON object tag -> count, most frequent first.

With ``format="tff-h5"`` the examples go instead to TFF's legacy HDF5 files
``stackoverflow_{train,held_out,test}.h5`` (``/examples/<client_id>/<feature>``,
see :mod:`fedprivacy.data.hdf5`); same seed, same posts in both formats.

Counts are occurrences in the train split (words: in ``tokens``; tags: posts
carrying the tag). TFF's real files count unique users instead; only the
resulting frequency order matters to the preprocessing.

The population mimics the real split rules: user ids ``0, 1, 2, ...`` are
zero-padded strings; users with ``id % 10 == 0`` are held out (all their posts
go to ``heldout``, about ``num_clients / 9`` users); the other ``num_clients``
users post before 2018 (``train``) and about 60% of them also post in 2018
(``test``). Examples per user are lognormal (median about 20, capped), word
frequencies are Zipf-like over a 20,000-word vocabulary with stop-words at the
top, and tags are Zipf-like over 1,000 tags with real names at the top. Each
tag owns a set of fairly frequent topical words (ranks 30-3,000, like "python",
"def", "self" on the real site) that are boosted in its posts, and each user has a few favourite tags, so tag prediction from the bag of
words is learnable and the data is non-IID.

Generation streams user by user (each user has its own generator seeded from
``(seed, user id)``) and writes rows in batched transactions, so memory stays
flat at the real scale (342,477 train users). Same seed, same bytes.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedprivacy.data.example_proto import encode_example
from fedprivacy.data.hdf5 import SPLIT_FILES, H5Writer

__all__ = ["SyntheticFiles", "generate", "SYNTHETIC_MARKER"]

SQLITE_NAME = "stackoverflow.sqlite"
WORD_COUNT_NAME = "stackoverflow.word_count"
TAG_COUNT_NAME = "stackoverflow.tag_count"
SYNTHETIC_MARKER = "synthetic.json"
"""Written beside the generated files: the generator's arguments (tells synthetic data from real)."""

_STOP_WORDS = (
    "the . , to i a is and in of it you that this for ) ( have with be on not can if but "
    "are my as do an or use so what at from will was there using want how get just your "
    "we all code like one : need ? when which ' would way some any then also here should "
    "me file new by now only data same try know am does other it's because work set up "
    "out value make no into method call has see more than could different find class "
    "where error each first function problem i'm don't these example help").split()
_REAL_TAGS = (
    "javascript java c# php python android jquery html c++ ios css mysql sql asp.net "
    "ruby-on-rails objective-c c .net arrays iphone r node.js angularjs json sql-server "
    "swift ruby regex ajax django excel xml asp.net-mvc linux database wpf spring "
    "wordpress python-2.7 string vba windows xcode eclipse html5 multithreading git bash "
    "reactjs mongodb vb.net scala algorithm performance postgresql image forms list "
    "twitter-bootstrap oracle function matlab hibernate visual-studio laravel apache "
    "winforms shell entity-framework qt rest api unit-testing sqlite loops pandas numpy "
    "typescript docker go haskell perl selenium csv").split()
_ONSETS = ("b c d f g h j k l m n p r s t v w z br ch cl cr dr fl gr pl pr sh sk sl sp st "
           "str th tr").split()
_VOWELS = "a e i o u a e i o ai ea ou".split()
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "x", "nd", "ng", "rk", "st")
_TAG_SUFFIXES = ("", "", "", "", "-api", ".js", "-2", "-cli", "-sdk", "-orm", "db", "-ui",
                 "-core", "-3")

VOCAB_SIZE = 20_000
NUM_TAGS = 1_000
_WORD_ZIPF = (2.7, 1.07)      # p(rank r) ∝ (r + 2.7)^-1.07, r = 1, 2, ...
_TAG_ZIPF = (3.0, 1.0)
_TOPIC_RANKS = (30, 3_000)    # topical words come from these frequency ranks (inside the 10k vocabulary)
_TOPIC_WORDS = 20             # topical words per tag
_TOPIC_SHARE = (0.3, 0.5)     # share of topical words in (tokens, title)
_TAGS_PER_POST = np.array([0.15, 0.40, 0.68, 0.87, 1.0])  # CDF of 1..5 tags per post
_EXAMPLES_MEDIAN, _EXAMPLES_SIGMA, _EXAMPLES_CAP = 20.0, 1.25, 2_000
_TOKENS_MEDIAN, _TOKENS_SIGMA, _TOKENS_CAP = 30.0, 0.8, 600
_TEST_USER_SHARE = 0.6
_DATES = {name: int(np.datetime64(day, "s").astype(np.int64)) for name, day in
          [("start", "2008-08-01"), ("last_start", "2017-09-01"), ("test", "2018-01-01"),
           ("end", "2019-01-01")]}
_BATCH_ROWS = 20_000

_SCHEMA = (
    "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
    "serialized_example_proto BLOB NOT NULL)",
    "CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, "
    "num_examples INTEGER NOT NULL)",
)
_INDEX = "CREATE INDEX examples_split_client ON examples (split_name, client_id)"


@dataclass(frozen=True)
class SyntheticFiles:
    """Paths of the files written by :func:`generate`.

    ``sqlite`` is set for ``format="tff-sqlite"``, ``h5`` (split name -> file) for
    ``format="tff-h5"``; the other is ``None``.
    """

    sqlite: Path | None
    word_count: Path
    tag_count: Path
    h5: dict[str, Path] | None = None

    def example_files(self) -> list[Path]:
        """The files holding the examples (one SQLite file or three HDF5 files)."""
        return [self.sqlite] if self.sqlite is not None else list(self.h5.values())


@dataclass(frozen=True)
class _World:
    """Seed-dependent topic structure shared by all users."""

    words: np.ndarray        # object array of str, by background frequency rank
    word_cdf: np.ndarray     # background word distribution for tokens
    title_cdf: np.ndarray    # same without punctuation, for titles
    tags: np.ndarray         # object array of tag names, by popularity rank
    tag_cdf: np.ndarray
    tag_words: np.ndarray    # int (NUM_TAGS, _TOPIC_WORDS): each tag's topical words
    topic_cdf: np.ndarray    # distribution over a tag's topical words


def _zipf_cdf(n: int, offset: float, exponent: float) -> np.ndarray:
    """CDF of p(rank r) ∝ (r + offset)^-exponent, r = 1..n, ending exactly at 1."""
    cdf = np.cumsum((np.arange(1, n + 1) + offset) ** -exponent)
    return cdf / cdf[-1]


def _sample(cdf: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling: indices into ``cdf`` for uniforms in [0, 1)."""
    return np.searchsorted(cdf, uniforms, side="right")


def _made_up(rng: np.random.Generator, syllables: np.ndarray,
             endings: tuple[str, ...]) -> list[str]:
    """Pronounceable made-up words with the given syllable counts (at most 4)."""
    n = len(syllables)
    parts = (np.array(_ONSETS, dtype=object)[rng.integers(len(_ONSETS), size=(n, 4))]
             + np.array(_VOWELS, dtype=object)[rng.integers(len(_VOWELS), size=(n, 4))])
    parts[np.arange(4) >= syllables[:, None]] = ""
    ending = np.array(endings, dtype=object)[rng.integers(len(endings), size=n)]
    return (parts.sum(axis=1) + ending).tolist()


def _fresh(candidates: list[str], taken: set[str], needed: int) -> list[str]:
    """Up to ``needed`` new distinct candidates, in order; adds them to ``taken``."""
    fresh = [c for c in dict.fromkeys(candidates) if c not in taken][:needed]
    taken.update(fresh)
    return fresh


@functools.cache
def _names() -> tuple[np.ndarray, np.ndarray]:
    """The fixed vocabulary and tag names (independent of the seed)."""
    rng = np.random.default_rng(20_170_101)
    taken = set(_STOP_WORDS)
    generated: list[str] = []
    while (needed := VOCAB_SIZE - len(_STOP_WORDS) - len(generated)) > 0:
        syllables = 1 + np.minimum(rng.exponential(1.2, 2 * needed).astype(np.int64), 3)
        generated += _fresh(_made_up(rng, syllables, _CODAS), taken, needed)
    # Shorter words tend to be more frequent.
    noisy_length = np.array([len(w) for w in generated]) + rng.normal(0.0, 2.0, len(generated))
    words = np.array(list(_STOP_WORDS) + [generated[i] for i in np.argsort(noisy_length)],
                     dtype=object)

    tags = list(_REAL_TAGS)
    taken = set(tags)
    while (needed := NUM_TAGS - len(tags)) > 0:
        syllables = rng.integers(1, 4, size=2 * needed)
        tags += _fresh(_made_up(rng, syllables, _TAG_SUFFIXES), taken, needed)
    return words, np.array(tags, dtype=object)


def _world(seed: int) -> _World:
    """Builds the seed-dependent topic structure."""
    words, tags = _names()
    rng = np.random.default_rng([seed, 0])
    lo, hi = _TOPIC_RANKS
    tag_words = np.stack([lo + rng.choice(hi - lo, _TOPIC_WORDS, replace=False)
                          for _ in range(NUM_TAGS)])
    weights = (np.arange(1, VOCAB_SIZE + 1) + _WORD_ZIPF[0]) ** -_WORD_ZIPF[1]
    weights[[i for i, w in enumerate(words[:len(_STOP_WORDS)]) if not w[0].isalpha()]] = 0.0
    title_cdf = np.cumsum(weights)
    return _World(words=words, word_cdf=_zipf_cdf(VOCAB_SIZE, *_WORD_ZIPF),
                  title_cdf=title_cdf / title_cdf[-1], tags=tags,
                  tag_cdf=_zipf_cdf(NUM_TAGS, *_TAG_ZIPF), tag_words=tag_words,
                  topic_cdf=_zipf_cdf(_TOPIC_WORDS, 1.0, 0.8))


def _draw_words(rng: np.random.Generator, world: _World, cdf: np.ndarray,
                lengths: np.ndarray, topic_share: float, post_tags: np.ndarray,
                tag_offsets: np.ndarray) -> np.ndarray:
    """Word ids for posts of the given lengths, mixing background and topical words.

    A word is topical with probability ``topic_share``; a topical word belongs to
    one of the post's tags, picked uniformly.
    """
    post = np.repeat(np.arange(len(lengths)), lengths)
    ids = _sample(cdf, rng.random(len(post)))
    topical = np.flatnonzero(rng.random(len(post)) < topic_share)
    owner = post[topical]
    n_tags = tag_offsets[owner + 1] - tag_offsets[owner]
    tag = post_tags[tag_offsets[owner] + (rng.random(len(owner)) * n_tags).astype(np.int64)]
    ids[topical] = world.tag_words[tag, _sample(world.topic_cdf, rng.random(len(owner)))]
    return ids


def _posts(rng: np.random.Generator, world: _World, favourites: np.ndarray, n: int,
           time_range: tuple[int, int], p_answer: float
           ) -> tuple[dict[str, list], np.ndarray, np.ndarray]:
    """Generates ``n`` posts of one user, oldest first.

    Returns:
        The posts as feature columns (feature name -> list of ``n`` values, the six TFF
        features), the token word ids and the tag ids (for counting).
    """
    times = np.sort(rng.integers(*time_range, size=n))
    answer = rng.random(n) < p_answer
    score = np.floor(rng.lognormal(0.0, 1.2, n)).astype(np.int64) - rng.binomial(1, 0.1, n)

    # Tags: the first one usually a favourite, the rest usually global; dedupe in order.
    n_tags = _sample(_TAGS_PER_POST, rng.random(n)) + 1
    owner = np.repeat(np.arange(n), n_tags)
    first = np.r_[0, np.cumsum(n_tags)[:-1]]
    p_fav = np.full(len(owner), 0.25)
    p_fav[first] = 0.75
    tag_ids = np.where(rng.random(len(owner)) < p_fav,
                       favourites[rng.integers(len(favourites), size=len(owner))],
                       _sample(world.tag_cdf, rng.random(len(owner))))
    _, keep = np.unique(owner * NUM_TAGS + tag_ids, return_index=True)
    keep.sort()
    owner, tag_ids = owner[keep], tag_ids[keep]
    tag_offsets = np.r_[0, np.cumsum(np.bincount(owner, minlength=n))]

    body_len = np.clip(np.rint(rng.lognormal(np.log(_TOKENS_MEDIAN), _TOKENS_SIGMA, n)), 1,
                       _TOKENS_CAP).astype(np.int64)
    title_len = rng.integers(5, 13, size=n)
    body = _draw_words(rng, world, world.word_cdf, body_len, _TOPIC_SHARE[0], tag_ids,
                       tag_offsets)
    title = _draw_words(rng, world, world.title_cdf, title_len, _TOPIC_SHARE[1], tag_ids,
                        tag_offsets)

    body_words, title_words = world.words[body].tolist(), world.words[title].tolist()
    body_offsets, title_offsets = np.r_[0, np.cumsum(body_len)], np.r_[0, np.cumsum(title_len)]
    tag_names = world.tags[tag_ids].tolist()
    dates = np.datetime_as_string(times.astype("datetime64[s]"))
    columns = {
        "creation_date": [f"{date.replace('T', ' ')} UTC" for date in dates],
        "score": score.tolist(),
        "tags": ["|".join(tag_names[tag_offsets[i]:tag_offsets[i + 1]]) for i in range(n)],
        "title": [" ".join(title_words[title_offsets[i]:title_offsets[i + 1]]) for i in range(n)],
        "tokens": [" ".join(body_words[body_offsets[i]:body_offsets[i + 1]]) for i in range(n)],
        "type": ["answer" if a else "question" for a in answer.tolist()],
    }
    return columns, body, tag_ids


def _num_examples(rng: np.random.Generator) -> int:
    """Heavy-tailed number of examples of one user (at least 1, capped)."""
    draw = rng.lognormal(np.log(_EXAMPLES_MEDIAN), _EXAMPLES_SIGMA)
    return int(np.clip(np.rint(draw), 1, _EXAMPLES_CAP))


def _user_splits(seed: int, user: int, world: _World
                 ) -> list[tuple[str, dict[str, list], np.ndarray, np.ndarray]]:
    """All posts of one user, grouped by split."""
    rng = np.random.default_rng([seed, 1, user])
    n_favourites = 1 + min(int(rng.poisson(1.2)), 4)
    favourites = np.unique(_sample(world.tag_cdf, rng.random(n_favourites)))
    p_answer = rng.beta(2.0, 1.5)
    start = int(rng.integers(_DATES["start"], _DATES["last_start"]))
    n = _num_examples(rng)
    if user % 10 == 0:
        return [("heldout", *_posts(rng, world, favourites, n, (start, _DATES["end"]),
                                    p_answer))]
    splits = [("train", *_posts(rng, world, favourites, n, (start, _DATES["test"]), p_answer))]
    if rng.random() < _TEST_USER_SHARE:
        n_test = max(1, int(rng.binomial(n, rng.beta(2.0, 8.0))))
        splits.append(("test", *_posts(rng, world, favourites, n_test,
                                       (_DATES["test"], _DATES["end"]), p_answer)))
    return splits


class _Writer:
    """Buffers rows and writes them in batched transactions."""

    def __init__(self, connection: sqlite3.Connection):
        self._connection = connection
        self._examples: list[tuple[str, str, bytes]] = []
        self._metadata: list[tuple[str, str, int]] = []

    def add(self, split: str, client_id: str, columns: dict[str, list]) -> None:
        names = list(columns)
        blobs = [encode_example(dict(zip(names, row))) for row in zip(*columns.values())]
        self._examples.extend((split, client_id, blob) for blob in blobs)
        self._metadata.append((client_id, split, len(blobs)))
        if len(self._examples) >= _BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        with self._connection:
            self._connection.executemany("INSERT INTO examples VALUES (?, ?, ?)", self._examples)
            self._connection.executemany("INSERT INTO client_metadata VALUES (?, ?, ?)",
                                         self._metadata)
        self._examples.clear()
        self._metadata.clear()


def _write_counts(world: _World, word_counts: np.ndarray, tag_counts: np.ndarray,
                  word_path: Path, tag_path: Path) -> None:
    """Writes the word and tag count files, most frequent first (ties by rank)."""
    order = np.lexsort((np.arange(VOCAB_SIZE), -word_counts))
    with open(word_path, "w", encoding="utf-8") as f:
        f.writelines(f"{world.words[i]} {word_counts[i]}\n" for i in order if word_counts[i])
    order = np.lexsort((np.arange(NUM_TAGS), -tag_counts))
    with open(tag_path, "w", encoding="utf-8") as f:
        json.dump({world.tags[i]: int(tag_counts[i]) for i in order if tag_counts[i]}, f)


def generate(out_dir: Path, num_clients: int = 1000, seed: int = 0, *,
             overwrite: bool = False, format: str = "tff-sqlite") -> SyntheticFiles:
    """Writes a synthetic StackOverflow dataset in TFF's on-disk format.

    Args:
        out_dir: Output directory (created if missing).
        num_clients: Number of train users (the real dataset has 342,477).
            About ``num_clients / 9`` held-out users are added.
        seed: Non-negative seed; the same seed gives byte-identical files.
        overwrite: Replace existing non-empty example files.
        format: ``"tff-sqlite"`` (``stackoverflow.sqlite``) or ``"tff-h5"`` (TFF's legacy
            ``stackoverflow_{train,held_out,test}.h5``). Both hold the same posts for the
            same seed.

    Returns:
        The paths of the files written.

    Raises:
        FileExistsError: If an example file exists, is not empty, and
            ``overwrite`` is false.
        ValueError: If ``num_clients < 1``, ``seed < 0`` or ``format`` is unknown.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    out_dir = Path(out_dir)
    if format == "tff-sqlite":
        files = SyntheticFiles(out_dir / SQLITE_NAME, out_dir / WORD_COUNT_NAME,
                               out_dir / TAG_COUNT_NAME)
    elif format == "tff-h5":
        files = SyntheticFiles(None, out_dir / WORD_COUNT_NAME, out_dir / TAG_COUNT_NAME,
                               h5={split: out_dir / name for split, name in SPLIT_FILES.items()})
    else:
        raise ValueError(f"format must be 'tff-sqlite' or 'tff-h5', got {format!r}")
    existing = [p for p in files.example_files() if p.exists() and p.stat().st_size > 0]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} already exists and is not empty; pass "
                              "overwrite=True to replace it")
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = [*files.example_files(), files.word_count, files.tag_count]
    partial = {path: path.with_name(path.name + ".partial") for path in targets}
    for path in partial.values():
        path.unlink(missing_ok=True)

    world = _world(seed)
    word_counts = np.zeros(VOCAB_SIZE, dtype=np.int64)
    tag_counts = np.zeros(NUM_TAGS, dtype=np.int64)
    num_users = num_clients + (num_clients - 1) // 9 + 1   # ids k with k % 10 == 0 held out
    width = max(8, len(str(num_users - 1)))

    def write_users(add) -> None:
        for user in range(num_users):
            for split, columns, token_ids, tag_ids in _user_splits(seed, user, world):
                add(split, f"{user:0{width}d}", columns)
                if split == "train":
                    word_counts[:] += np.bincount(token_ids, minlength=VOCAB_SIZE)
                    tag_counts[:] += np.bincount(tag_ids, minlength=NUM_TAGS)

    if files.sqlite is not None:
        connection = sqlite3.connect(partial[files.sqlite])
        try:
            connection.execute("PRAGMA journal_mode = OFF")
            connection.execute("PRAGMA synchronous = OFF")
            for statement in _SCHEMA:
                connection.execute(statement)
            writer = _Writer(connection)
            write_users(writer.add)
            writer.flush()
            with connection:
                connection.execute(_INDEX)
        finally:
            connection.close()
    else:
        with H5Writer({split: partial[path] for split, path in files.h5.items()}) as writer:
            write_users(writer.add)
    _write_counts(world, word_counts, tag_counts, partial[files.word_count],
                  partial[files.tag_count])
    for path, temporary in partial.items():
        os.replace(temporary, path)
    (out_dir / SYNTHETIC_MARKER).write_text(json.dumps(
        {"generator": __name__, "num_clients": num_clients, "seed": seed, "format": format}))
    return files
