"""Synthetic StackOverflow data in TensorFlow Federated's on-disk format, shaped like TFF's.

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
see :mod:`fedprivacy.data.hdf5`); same seed, same examples in both formats.

Counts are occurrences in the train split (words: in ``tokens``; tags: examples
carrying the tag). TFF's real files count unique users instead; only the
resulting frequency order matters to the preprocessing.

The data follow TFF's published shape (docs/DATA.md compares the statistics):

* **Users.** Ids ``0, 1, 2, ...`` are zero-padded strings; users with ``id % 10 ==
  0`` are held out (all their examples, from every year, go to ``heldout``; about
  ``num_clients / 9`` users); the other ``num_clients`` users write before 2018
  (``train``) and about 60% of them (TFF: 204,088 of 342,477; always the first) also in 2018
  (``test``, about a fifth of their train count). Train examples per user are
  ``min_examples`` plus a lognormal excess (a heavy tail), capped at
  ``max_examples``, with mean ``mean_examples``: by default at least 100 (TFF
  drops users with fewer than 100 sentences) and 397 on average (TFF: 135,818,730
  train examples over 342,477 users).
* **Examples are sentences.** A post (question or answer) has a few sentences;
  each is one example whose ``tokens`` is the sentence and whose ``title``,
  ``tags``, ``creation_date``, ``score`` and ``type`` are the post's.
* **Words.** A Zipf-like background over a 50,000-word vocabulary, stop-words
  at the top, with about a tenth of the tokens outside the 10,000 most frequent
  words. Label information rises into the tail: each tag belongs to one of 40
  areas whose generic words (frequency ranks 30-1,000, like "function" or
  "array") are shared by all its tags, and each tag owns a dozen "API names"
  (background ranks 1,000-30,000, like "numpy" or "viewcontroller"), two of them shared with
  one other tag of its area, that occur almost only in its posts.
* **Tags.** 1 to 5 per post (Stack Overflow's rule), Zipf-like over 1,000 tags
  with real names at the top; each user has a few favourite tags (non-IID users).

Generation streams user by user (each user has its own generator seeded from
``(seed, user id)``) and writes rows in batched transactions, so memory stays
flat at the real scale (342,477 train users; see docs/DATA.md for its time and
disk). Same seed and arguments, same bytes.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedprivacy.data.hdf5 import SPLIT_FILES, H5Writer
from fedprivacy.data.progress import with_progress
from fedprivacy.data.sources import file_identity

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["SyntheticFiles", "generate", "SYNTHETIC_MARKER", "TFF_MIN_EXAMPLES",
           "TFF_MEAN_EXAMPLES"]

SQLITE_NAME = "stackoverflow.sqlite"
WORD_COUNT_NAME = "stackoverflow.word_count"
TAG_COUNT_NAME = "stackoverflow.tag_count"
SYNTHETIC_MARKER = "synthetic.json"
"""Written beside the generated files: the generator's arguments (tells synthetic data from real)."""

TFF_MIN_EXAMPLES = 100
"""TFF keeps only users with at least 100 sentences."""
TFF_MEAN_EXAMPLES = 397
"""TFF's train split: 135,818,730 examples over 342,477 users (396.6 per user)."""
DEFAULT_MAX_EXAMPLES = 20_000
"""Default cap on a user's train examples (the default tail passes it about once per 20,000 users)."""

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

VOCAB_SIZE = 50_000
NUM_TAGS = 1_000
_WORD_ZIPF = (2.7, 1.07)      # background p(rank r) ∝ (r + 2.7)^-1.07, r = 1, 2, ...
_TAG_ZIPF = (3.0, 1.0)
_AREAS = 40                   # tags fall into areas; an area's generic words are shared by its tags
_AREA_RANKS = (30, 1_000)     # generic topical words come from these background ranks
_AREA_WORDS = 50
_API_RANKS = (1_000, 30_000)  # API names: log-uniform over these background ranks
_API_WORDS = 12               # per tag; the last _API_SHARED are another tag's (same area)
_API_SHARED = 2
_TOPIC_SHARE = {"tokens": (0.08, 0.15), "title": (0.15, 0.30)}  # (area, API) share of words
_TAGS_PER_POST = np.array([0.15, 0.40, 0.68, 0.87, 1.0])  # CDF of 1..5 tags per post
_EXCESS_SIGMA = 1.3           # lognormal sigma of a user's examples beyond min_examples
_SENTENCES_PER_POST = 4.0     # 1 + Poisson(4) sentences per post
_TOKENS_MEDIAN, _TOKENS_SIGMA, _TOKENS_CAP = 11.0, 0.6, 120   # tokens per sentence
_TEST_USER_SHARE = 204_088 / 342_477
_TEST_SHARE_BETA = (2.0, 8.0)  # a test user's 2018 examples: about a fifth of their train count
_DATES = {name: int(np.datetime64(day, "s").astype(np.int64)) for name, day in
          [("start", "2008-08-01"), ("last_start", "2017-09-01"), ("test", "2018-01-01"),
           ("end", "2019-01-01")]}
_BATCH_ROWS = 50_000
_FEATURES = ("creation_date", "score", "tags", "title", "tokens", "type")

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
class _GuidedCDF:
    """Inverse-CDF sampling through a guide table; the indices of :func:`_sample`, exactly.

    ``guide[k]`` is the number of CDF entries ``<= k / M`` (``M`` buckets, a power of two with at
    least four per entry: ``2^18`` for the 50,000 words, ``2^12`` for the 1,000 tags). For a uniform
    ``u``, ``k = floor(u M)`` is exact (``M`` is a power of two), so ``k / M <= u`` and the answer
    (the number of entries ``<= u``) is at least ``guide[k]``; it is reached by stepping up while
    ``cdf[idx] <= u``, a few vectorized passes since few entries share a bucket; only the first pass
    reads every uniform, the later ones only those that stepped (about one in twelve on the word CDF,
    then one in eighty). Same indices as ``np.searchsorted(cdf, u, side="right")``, whose cache misses
    and mispredicted branches grow with the number of uniforms: on the word CDF 2.3 times faster for
    5,000 uniforms (a mean user's sentences) and 15 times for 50,000; on the 50 area words 1.4 times
    for 3,000 and 7.7 times for 20,000, a few microseconds slower below a thousand (2 vCPU, load 6,
    2026-11-28). The large users, which dominate the cost, gain the most.
    """

    cdf: np.ndarray
    guide: np.ndarray

    @classmethod
    def of(cls, cdf: np.ndarray) -> _GuidedCDF:
        buckets = 1 << max(10, (len(cdf) - 1).bit_length() + 2)
        return cls(np.append(cdf, np.inf),
                   np.searchsorted(cdf, np.arange(buckets) / buckets, side="right").astype(np.int32))

    def __call__(self, uniforms: np.ndarray) -> np.ndarray:
        idx = self.guide[(uniforms * len(self.guide)).astype(np.int64)].astype(np.int64)
        moving = np.flatnonzero(self.cdf[idx] <= uniforms)
        while len(moving):
            idx[moving] += 1
            moving = moving[self.cdf[idx[moving]] <= uniforms[moving]]
        return idx


@dataclass(frozen=True)
class _World:
    """Seed-dependent topic structure shared by all users."""

    words: np.ndarray        # object array of str, by background frequency rank
    word_cdf: _GuidedCDF     # background word distribution for tokens
    title_cdf: _GuidedCDF    # same without punctuation, for titles
    tags: np.ndarray         # object array of tag names, by popularity rank
    tag_cdf: _GuidedCDF
    area_words: np.ndarray   # int (NUM_TAGS, _AREA_WORDS): the generic words of each tag's area
    area_cdf: _GuidedCDF
    api_words: np.ndarray    # int (NUM_TAGS, _API_WORDS): each tag's API names
    api_cdf: _GuidedCDF


@dataclass(frozen=True)
class _Sizes:
    """Distribution of a user's number of train examples."""

    minimum: int
    mean: float
    maximum: int
    mu: float                # lognormal location of the excess over ``minimum``

    def draw(self, rng: np.random.Generator) -> int:
        if self.mean >= self.maximum:
            return self.maximum
        if self.mean <= self.minimum:
            return self.minimum
        excess = rng.lognormal(self.mu, _EXCESS_SIGMA)
        return int(min(self.minimum + np.rint(excess), self.maximum))


def _capped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X lognormal(mu, sigma)."""
    phi = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
    log_cap = math.log(cap)
    return (math.exp(mu + sigma ** 2 / 2) * phi((log_cap - mu - sigma ** 2) / sigma)
            + cap * (1.0 - phi((log_cap - mu) / sigma)))


@functools.cache
def _sizes(min_examples: int, mean_examples: float, max_examples: int) -> _Sizes:
    """Validates the size arguments and solves for the lognormal location."""
    if not 1 <= min_examples <= mean_examples <= max_examples:
        raise ValueError("need 1 <= min_examples <= mean_examples <= max_examples, got "
                         f"{min_examples}, {mean_examples}, {max_examples}")
    if mean_examples >= max_examples or mean_examples <= min_examples:
        return _Sizes(min_examples, mean_examples, max_examples, 0.0)
    target, cap = mean_examples - min_examples, max_examples - min_examples
    lo, hi = -20.0, math.log(cap) + 20.0
    for _ in range(200):          # the capped mean increases with mu
        mid = (lo + hi) / 2
        below = _capped_lognormal_mean(mid, _EXCESS_SIGMA, cap) < target
        lo, hi = (mid, hi) if below else (lo, mid)
    return _Sizes(min_examples, mean_examples, max_examples, (lo + hi) / 2)


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


@functools.cache
def _world(seed: int) -> _World:
    """Builds the seed-dependent topic structure."""
    words, tags = _names()
    rng = np.random.default_rng([seed, 0])
    # Areas: each tag's generic words, shared with every tag of its area.
    lo, hi = _AREA_RANKS
    area_of_tag = rng.integers(_AREAS, size=NUM_TAGS)
    area_words = np.stack([lo + rng.choice(hi - lo, _AREA_WORDS, replace=False)
                           for _ in range(_AREAS)])[area_of_tag]
    # API names: distinct background ranks, log-uniform over _API_RANKS (past the area
    # words' ranks: API names are rarer than generic words); the last _API_SHARED of a
    # tag's are those of another tag of its area (or of the next tag, for an area of one
    # tag), so they are tied to two tags.
    own = _API_WORDS - _API_SHARED
    lo, hi = np.log(_API_RANKS[0]), np.log(_API_RANKS[1])
    chosen: dict[int, None] = {}
    while len(chosen) < NUM_TAGS * own:
        draws = np.exp(rng.uniform(lo, hi, 2 * NUM_TAGS * own)).astype(np.int64)
        chosen.update(dict.fromkeys(draws.tolist()))
    api = np.array(list(chosen)[:NUM_TAGS * own], dtype=np.int64).reshape(NUM_TAGS, own)
    partner = np.empty(NUM_TAGS, dtype=np.int64)
    for tag in range(NUM_TAGS):
        mates = np.flatnonzero(area_of_tag == area_of_tag[tag])
        mates = mates[mates != tag]
        partner[tag] = rng.choice(mates) if len(mates) else (tag + 1) % NUM_TAGS
    api_words = np.concatenate([api, api[partner, :_API_SHARED]], axis=1)

    weights = (np.arange(1, VOCAB_SIZE + 1) + _WORD_ZIPF[0]) ** -_WORD_ZIPF[1]
    weights[[i for i, w in enumerate(words[:len(_STOP_WORDS)]) if not w[0].isalpha()]] = 0.0
    title_cdf = np.cumsum(weights)
    return _World(words=words, word_cdf=_GuidedCDF.of(_zipf_cdf(VOCAB_SIZE, *_WORD_ZIPF)),
                  title_cdf=_GuidedCDF.of(title_cdf / title_cdf[-1]), tags=tags,
                  tag_cdf=_GuidedCDF.of(_zipf_cdf(NUM_TAGS, *_TAG_ZIPF)), area_words=area_words,
                  area_cdf=_GuidedCDF.of(_zipf_cdf(_AREA_WORDS, 1.0, 0.8)), api_words=api_words,
                  api_cdf=_GuidedCDF.of(_zipf_cdf(_API_WORDS, 1.0, 0.9)))


def _draw_words(rng: np.random.Generator, world: _World, post: np.ndarray, num_tokens: int,
                post_tags: np.ndarray, tag_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Word ids of a block's sentences and of its titles, mixing background and topical words.

    Word ``i`` belongs to post ``post[i]``; the first ``num_tokens`` words are the sentences', the others the
    titles'. A word is an area word with probability ``shares[0]`` and an API name with probability ``shares[1]``
    (:data:`_TOPIC_SHARE`: ``tokens`` for sentences, ``title`` for titles); a topical word belongs to one of its
    post's tags, picked uniformly. The uniforms come in this order, which defines the data: for the sentences, then
    for the titles, ``m`` background uniforms and ``m`` kind uniforms (``m`` words), then for the area words, then
    for the API names, ``k`` tag picks and ``k`` uniforms over the kind's CDF. ``Generator.random`` fills arrays
    from one stream of doubles, so a call for ``a + b`` uniforms gives those of calls for ``a`` and ``b``: the
    draws are taken in three calls (the sizes of the later ones depend on the kind uniforms) and sliced, and the
    topical words of both parts are drawn together.
    """
    m_tok, m_title = num_tokens, len(post) - num_tokens
    first = rng.random(2 * m_tok)
    tok_area, tok_api = _kind_positions(first[m_tok:], _TOPIC_SHARE["tokens"])
    tok_topical = len(tok_area) + len(tok_api)
    second = rng.random(2 * tok_topical + 2 * m_title)
    title_uniforms = second[2 * tok_topical:]
    title_area, title_api = _kind_positions(title_uniforms[m_title:], _TOPIC_SHARE["title"])
    third = rng.random(2 * (len(title_area) + len(title_api)))

    words = np.concatenate([world.word_cdf(first[:m_tok]), world.title_cdf(title_uniforms[:m_title])])
    # Topical words grouped (sentence area, title area, sentence API, title API); where each group's picks start
    # in ``uniforms`` (its CDF uniforms follow them).
    area = np.concatenate([tok_area, m_tok + title_area])
    api = np.concatenate([tok_api, m_tok + title_api])
    topical = np.concatenate([area, api])
    sizes = np.array([len(tok_area), len(title_area), len(tok_api), len(title_api)])
    group_starts = 2 * np.array([0, tok_topical, len(tok_area), tok_topical + len(title_area)])
    uniforms = np.concatenate([second[:2 * tok_topical], third])
    pick = np.arange(len(topical)) + np.repeat(group_starts - (np.cumsum(sizes) - sizes), sizes)
    owner = post[topical]
    first_tag = tag_offsets[owner]
    tag = post_tags[first_tag + (uniforms[pick] * (tag_offsets[owner + 1] - first_tag)).astype(np.int64)]
    kind_uniforms = uniforms[pick + np.repeat(sizes, sizes)]
    n_area = len(area)
    words[area] = world.area_words[tag[:n_area], world.area_cdf(kind_uniforms[:n_area])]
    words[api] = world.api_words[tag[n_area:], world.api_cdf(kind_uniforms[n_area:])]
    return words[:m_tok], words[m_tok:]


def _kind_positions(u: np.ndarray, shares: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the area words (``u < shares[0]``) and of the API names (``shares[0] <= u < shares[0] +
    shares[1]``) among words with kind uniforms ``u``."""
    topical = np.flatnonzero(u < shares[0] + shares[1])
    is_area = u[topical] < shares[0]
    return topical[is_area], topical[~is_area]


def _varint(value: int) -> bytes:
    """Protobuf varint of a non-negative integer below 2^64."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SHORT_VARINTS = tuple(_varint(v) for v in range(1 << 14))
"""``_varint(v)`` for ``v < 2^14`` (one or two bytes: every length of a generated example's fields and of all but
the longest examples), looked up instead of built."""


def _delimited(field_byte: bytes, payload: bytes) -> bytes:
    """A length-delimited protobuf field: its tag byte, the length, the payload."""
    return field_byte + _length(len(payload)) + payload


def _entry(name: bytes, feature: bytes) -> bytes:
    """One ``Features.feature`` map entry (key 1, value 2), as a field of ``Features``."""
    return _delimited(b"\x0a", _delimited(b"\x0a", name) + _delimited(b"\x12", feature))


def _length(n: int) -> bytes:
    """The varint length prefix of an ``n``-byte payload."""
    return _SHORT_VARINTS[n] if n < len(_SHORT_VARINTS) else _varint(n)


def _bytes_entry(name: bytes, value: str) -> bytes:
    """Entry of a one-value ``bytes_list`` feature (Feature field 1, BytesList field 1): ``_entry(name,
    _delimited(0a, _delimited(0a, value)))``, framed by :func:`_bytes_framing` and joined once."""
    data = value.encode("utf-8")
    return _bytes_framing(name, len(data)) + data


@functools.lru_cache(maxsize=4096)
def _bytes_framing(name: bytes, n_value: int) -> bytes:
    """The bytes of a one-value ``bytes_list`` entry that precede its ``n_value``-byte value: the nested lengths
    added up first (each ``_delimited`` would copy the payload again). They depend on the length only, so they are
    built once per (name, length): a few hundred distinct lengths frame the ~400,000 sentences of the quickstart."""
    value_len = _length(n_value)
    n_list = 1 + len(value_len) + n_value
    list_len = _length(n_list)
    n_feature = 1 + len(list_len) + n_list
    feature_len = _length(n_feature)
    n_entry = 2 + len(name) + 1 + len(feature_len) + n_feature  # names are shorter than 128 bytes
    return b"".join((b"\x0a", _length(n_entry), b"\x0a", _SHORT_VARINTS[len(name)], name, b"\x12", feature_len,
                     b"\x0a", list_len, b"\x0a", value_len))


@functools.lru_cache(maxsize=4096)
def _int64_entry(name: bytes, value: int) -> bytes:
    """Entry of a one-value ``int64_list`` feature (Feature field 3, packed Int64List field 1); cached, as a post's
    score takes a few dozen values."""
    return _entry(name, _delimited(b"\x1a", _delimited(b"\x0a", _varint(value % (1 << 64)))))


@dataclass(frozen=True)
class _Block:
    """Examples of one user in one split: posts, and sentences pointing at their post."""

    post_columns: dict[str, list]   # the five post-level features, one value per post
    sentences: list[str]            # the ``tokens`` of each example
    post_of: np.ndarray             # int, the post of each example
    token_ids: np.ndarray           # word ids of all the sentences (for counting)
    tag_ids: np.ndarray             # tag ids of each example's tags (for counting)

    def __len__(self) -> int:
        return len(self.sentences)

    def columns(self) -> dict[str, list]:
        """The six features as columns of one value per example (sorted by name)."""
        post_of = self.post_of.tolist()
        columns = {name: [values[p] for p in post_of]
                   for name, values in self.post_columns.items()}
        columns["tokens"] = self.sentences
        return {name: columns[name] for name in _FEATURES}

    def blobs(self) -> list[bytes]:
        """The examples as serialized ``tf.train.Example`` protos.

        Byte-identical to :func:`fedprivacy.data.example_proto.encode_example` (map
        entries in sorted key order), but the post's features are encoded once.
        """
        cols = self.post_columns
        heads = [_bytes_entry(b"creation_date", d) + _int64_entry(b"score", s)
                 + _bytes_entry(b"tags", t) + _bytes_entry(b"title", ti)
                 for d, s, t, ti in zip(cols["creation_date"], cols["score"], cols["tags"],
                                        cols["title"])]
        tails = [_bytes_entry(b"type", t) for t in cols["type"]]
        post_bytes = [len(head) + len(tail) for head, tail in zip(heads, tails)]
        blobs = []
        for post, sentence in zip(self.post_of.tolist(), self.sentences):
            data = sentence.encode("utf-8")
            framing = _bytes_framing(b"tokens", len(data))
            blobs.append(b"".join((b"\x0a", _length(post_bytes[post] + len(framing) + len(data)), heads[post],
                                   framing, data, tails[post])))
        return blobs


@dataclass(frozen=True)
class _Draws:
    """The random draws of one user's block, before any string is built.

    Posts ``p = 0..num_posts-1``; sentence (example) ``j`` belongs to post ``post_of[j]`` and has
    ``sentence_len[j]`` words; the words of all sentences are ``tokens`` (word ids, background
    frequency ranks), those of all titles ``title`` (``title_len[p]`` per post); post ``p``'s tags
    are ``tag_ids[tag_offsets[p]:tag_offsets[p + 1]]`` (distinct, in drawn order).
    """

    post_of: np.ndarray
    times: np.ndarray
    answer: np.ndarray
    score: np.ndarray
    tag_ids: np.ndarray
    tag_offsets: np.ndarray
    sentence_len: np.ndarray
    title_len: np.ndarray
    tokens: np.ndarray
    title: np.ndarray

    @property
    def num_posts(self) -> int:
        return len(self.title_len)

    def example_tags(self) -> np.ndarray:
        """Tag ids of each example's tags, example after example (what the tag counts count)."""
        counts = np.diff(self.tag_offsets)[self.post_of]          # tags of each example
        starts = np.cumsum(counts) - counts                       # where its tags go in the output
        return self.tag_ids[np.arange(counts.sum()) + np.repeat(self.tag_offsets[self.post_of] - starts, counts)]


def _draw_block(rng: np.random.Generator, world: _World, favourites: np.ndarray, n: int,
                time_range: tuple[int, int], p_answer: float) -> _Draws:
    """Draws ``n`` examples (sentences) of one user, oldest post first."""
    # Posts until n sentences; the last post keeps only the sentences needed.
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
    score = (np.floor(rng.lognormal(0.0, 1.2, num_posts)).astype(np.int64)
             - rng.binomial(1, 0.1, num_posts))

    # Tags: the first one usually a favourite, the rest usually global; dedupe in order.
    n_tags = _sample(_TAGS_PER_POST, rng.random(num_posts)) + 1
    owner = np.repeat(np.arange(num_posts), n_tags)
    first = np.cumsum(n_tags) - n_tags
    p_fav = np.full(len(owner), 0.25)
    p_fav[first] = 0.75
    tag_ids = np.where(rng.random(len(owner)) < p_fav,
                       favourites[rng.integers(len(favourites), size=len(owner))],
                       world.tag_cdf(rng.random(len(owner))))
    _, keep = np.unique(owner * NUM_TAGS + tag_ids, return_index=True)
    keep.sort()
    owner, tag_ids = owner[keep], tag_ids[keep]
    tag_offsets = np.zeros(num_posts + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=num_posts), out=tag_offsets[1:])

    sentence_len = np.clip(np.rint(rng.lognormal(np.log(_TOKENS_MEDIAN), _TOKENS_SIGMA, n)),
                           1, _TOKENS_CAP).astype(np.int64)
    title_len = rng.integers(5, 13, size=num_posts)
    tokens, title = _draw_words(rng, world, np.repeat(np.concatenate([post_of, np.arange(num_posts)]),
                                                      np.concatenate([sentence_len, title_len])),
                                int(sentence_len.sum()), tag_ids, tag_offsets)
    return _Draws(post_of, times, answer, score, tag_ids, tag_offsets, sentence_len, title_len,
                  tokens, title)


def _render(world: _World, draws: _Draws) -> _Block:
    """The examples of drawn block as strings: words and tags by name, dates as TFF writes them."""
    num_posts = draws.num_posts
    token_words, title_words = world.words[draws.tokens].tolist(), world.words[draws.title].tolist()
    sentence_ends = np.cumsum(draws.sentence_len).tolist()
    title_ends = np.cumsum(draws.title_len).tolist()
    tag_names = world.tags[draws.tag_ids].tolist()
    tag_ends = draws.tag_offsets.tolist()
    dates = np.datetime_as_string(draws.times.astype("datetime64[s]"))
    post_columns = {
        "creation_date": [f"{date.replace('T', ' ')} UTC" for date in dates],
        "score": draws.score.tolist(),
        "tags": ["|".join(tag_names[tag_ends[i]:tag_ends[i + 1]]) for i in range(num_posts)],
        "title": [" ".join(title_words[a:b]) for a, b in zip([0, *title_ends], title_ends)],
        "type": ["answer" if a else "question" for a in draws.answer.tolist()],
    }
    sentences = [" ".join(token_words[a:b]) for a, b in zip([0, *sentence_ends], sentence_ends)]
    return _Block(post_columns, sentences, draws.post_of, draws.tokens, draws.example_tags())


def _user_draws(seed: int, user: int, world: _World, sizes: _Sizes, *,
                first_only: bool = False) -> list[tuple[str, _Draws]]:
    """The draws of all examples of one user, grouped by split (a pure function of its arguments).

    With ``first_only``, only the first split's (``heldout`` or ``train``): its draws come first in the user's
    stream, so they are the same, and the ``test`` block is not drawn.
    """
    rng = np.random.default_rng([seed, 1, user])
    n_favourites = 1 + min(int(rng.poisson(1.2)), 4)
    favourites = np.unique(world.tag_cdf(rng.random(n_favourites)))
    p_answer = rng.beta(2.0, 1.5)
    start = int(rng.integers(_DATES["start"], _DATES["last_start"]))
    n = sizes.draw(rng)
    in_test = rng.random() < _TEST_USER_SHARE or user == 1  # user 1 (the first train user): every split exists
    n_test = max(1, int(rng.binomial(n, rng.beta(*_TEST_SHARE_BETA)))) if in_test else 0
    if user % 10 == 0:
        return [("heldout", _draw_block(rng, world, favourites, n + n_test, (start, _DATES["end"]),
                                        p_answer))]
    splits = [("train", _draw_block(rng, world, favourites, n, (start, _DATES["test"]), p_answer))]
    if n_test and not first_only:
        splits.append(("test", _draw_block(rng, world, favourites, n_test,
                                           (_DATES["test"], _DATES["end"]), p_answer)))
    return splits


def _user_splits(seed: int, user: int, world: _World, sizes: _Sizes) -> list[tuple[str, _Block]]:
    """All examples of one user, grouped by split, rendered to strings."""
    return [(split, _render(world, draws)) for split, draws in _user_draws(seed, user, world, sizes)]


class _Writer:
    """Buffers rows and writes them in batched transactions."""

    def __init__(self, connection: sqlite3.Connection):
        self._connection = connection
        self._examples: list[tuple[str, str, bytes]] = []
        self._metadata: list[tuple[str, str, int]] = []

    def add(self, split: str, client_id: str, block: _Block) -> None:
        blobs = block.blobs()
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


def _add_counts(word_counts: np.ndarray, tag_counts: np.ndarray, token_ids: np.ndarray,
                example_tags: np.ndarray) -> None:
    """Adds one train block to the counts: word occurrences in ``tokens``, examples carrying each tag."""
    word_counts += np.bincount(token_ids, minlength=VOCAB_SIZE)
    tag_counts += np.bincount(example_tags, minlength=NUM_TAGS)


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
             overwrite: bool = False, format: str = "tff-sqlite",
             min_examples: int = TFF_MIN_EXAMPLES, mean_examples: float = TFF_MEAN_EXAMPLES,
             max_examples: int = DEFAULT_MAX_EXAMPLES, console: Console | None = None) -> SyntheticFiles:
    """Writes a synthetic StackOverflow dataset in TFF's on-disk format.

    Args:
        out_dir: Output directory (created if missing).
        num_clients: Number of train users (the real dataset has 342,477).
            About ``num_clients / 9`` held-out users are added.
        seed: Non-negative seed; the same seed (and sizes) gives byte-identical files.
        overwrite: Replace existing non-empty example files.
        format: ``"tff-sqlite"`` (``stackoverflow.sqlite``) or ``"tff-h5"`` (TFF's legacy
            ``stackoverflow_{train,held_out,test}.h5``). Both hold the same examples for
            the same seed.
        min_examples: Fewest train examples (sentences) of a user; TFF's 100 by default.
            A held-out user has at least as many; a user's 2018 (test) examples are not
            bounded below.
        mean_examples: Mean train examples per user; TFF's 397 by default.
        max_examples: Cap on a user's train examples (the lognormal tail is solved so
            that the capped mean is ``mean_examples``).
        console: Where the users written are shown as a bar when it is a terminal
            (default: stderr; :func:`~fedprivacy.data.progress.with_progress`).

    Returns:
        The paths of the files written.

    Raises:
        FileExistsError: If an example file exists, is not empty, and
            ``overwrite`` is false.
        ValueError: If ``num_clients < 1``, ``seed < 0``, ``format`` is unknown, or not
            ``1 <= min_examples <= mean_examples <= max_examples``.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    sizes = _sizes(min_examples, mean_examples, max_examples)
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
        for user in with_progress(range(num_users), num_users, "generating", "users", console):
            for split, block in _user_splits(seed, user, world, sizes):
                add(split, f"{user:0{width}d}", block)
                if split == "train":
                    _add_counts(word_counts, tag_counts, block.token_ids, block.tag_ids)

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
            write_users(lambda split, client, block: writer.add(split, client, block.columns()))
    _write_counts(world, word_counts, tag_counts, partial[files.word_count],
                  partial[files.tag_count])
    for path, temporary in partial.items():
        os.replace(temporary, path)
    (out_dir / SYNTHETIC_MARKER).write_text(json.dumps(
        {"generator": __name__, "num_clients": num_clients, "seed": seed, "format": format,
         "min_examples": min_examples, "mean_examples": mean_examples,
         "max_examples": max_examples, "files": {path.name: written_identity(path) for path in targets}}))
    return files


def written_identity(path: Path) -> dict[str, object]:
    """What the marker records of a file it wrote: its size, mtime and the SHA-256 of its ends
    (:func:`~fedprivacy.data.sources.file_identity` without the path, so a moved folder keeps it)."""
    identity = file_identity(path)
    del identity["path"]
    return identity
