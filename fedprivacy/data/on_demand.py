"""The synthetic StackOverflow population generated on demand, straight to tag-prediction rows.

:mod:`fedprivacy.data.synthetic` draws every user from its own generator seeded
``(seed, 1, user)`` (:func:`~fedprivacy.data.synthetic._user_draws`), so a user is a pure
function of the seed, its id and the size arguments. :class:`OnDemandPopulation` uses that to
serve any population size without files: user ``u``'s examples are drawn when asked for, by the
SAME draw code and RNG call sequence as :func:`~fedprivacy.data.synthetic.generate`, so an
on-demand user equals the stored user of the same seed, example for example. Memory and time
grow with the users asked for (a round's cohort, the evaluation set), not with the population.

Splits, as :func:`~fedprivacy.data.synthetic.generate` defines them: the population has
``num_users = num_clients + (num_clients - 1) // 9 + 1`` ids; ids ``u % 10 == 0`` are held out;
the ``i``-th train user (client ``i``) is ``u = i + i // 9 + 1``; a train user is in ``test``
when its own draws say so (about 60%, always user 1).

**Fast path to tag rows.** :class:`TagRows` maps the drawn word ids to vocabulary columns with a
lookup array (word rank -> column, -1 outside the top ``vocab_size`` of the word count file) and
tag ids likewise: the words are distinct whitespace-free strings, one per rank, so this equals
tokenizing the rendered ``tokens + ' ' + title`` (:func:`~fedprivacy.data.tag_prediction._client_rows`),
and the rows are identical: x = count / #words (out-of-vocabulary words in the denominator),
label = lowest in-vocabulary tag column, multi-hot tags (AdaDPS preprocessing, Li et al. 2022,
arXiv:2202.05963v2, §6.2; TFF's, Reddi et al. 2021, arXiv:2003.00295, App. C). No string is built.

**Vocabulary.** The columns need the word and tag counts (train occurrences, as ``generate``
writes them). :func:`count_files` counts the first ``min(num_clients, COUNT_SAMPLE_USERS)`` train
users: for a population of at most 10,000 users that is every train user, so the count files,
and every row, equal the stored data's exactly; a larger population takes its vocabulary from
this fixed deterministic sample (a word's rank is then estimated from 10,000 users' ~4M
sentences instead of all of them; only the order of the top ``vocab_size`` words and
``num_tags`` tags matters). The two files are written once, in TFF's format, to a folder named
for the generator's arguments; drawing 10,000 users took 12 s on the 2-core machine, later runs
read the files (milliseconds).

**Files the generator wrote.** :func:`generated_population` recognizes a folder written by
:func:`~fedprivacy.data.synthetic.generate` whose files are still exactly as written (the marker records
each file's size, mtime and the SHA-256 of its ends, as the preprocessing cache checks them), and
:func:`generated_tag_rows` then gives its rows from the draws instead of decoding and tokenizing the
stored examples: the same rows (above), without the decoding, which was about two thirds of the quickstart's
data preparation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedprivacy.data.sources import ExampleSource
from fedprivacy.data.stackoverflow import read_tag_counts, read_word_counts
from fedprivacy.data.synthetic import (NUM_TAGS, SYNTHETIC_MARKER, TAG_COUNT_NAME, VOCAB_SIZE, WORD_COUNT_NAME,
                                       _add_counts, _Draws, _sizes, _user_draws, _world, _write_counts,
                                       written_identity)
from fedprivacy.data.tag_prediction import FederatedTagData, NoTag, _ClientRows, assemble, iter_tag_rows

__all__ = ["COUNT_SAMPLE_USERS", "OnDemandPopulation", "TagRows", "OnDemandTags", "count_files", "count_paths",
           "generated_population", "generated_tag_rows"]

COUNT_SAMPLE_USERS = 10_000
"""Train users whose examples define the vocabulary (all of them in a population this small or smaller)."""


@dataclass(frozen=True)
class OnDemandPopulation:
    """The users of ``generate(num_clients=num_clients, seed=seed, min_examples=..., ...)``, drawn on demand."""

    num_clients: int
    seed: int
    min_examples: int
    mean_examples: float
    max_examples: int

    def __post_init__(self) -> None:
        if self.num_clients < 1 or self.seed < 0:
            raise ValueError(f"need num_clients >= 1 and seed >= 0, got {self.num_clients}, {self.seed}")
        _sizes(self.min_examples, self.mean_examples, self.max_examples)  # raises on inconsistent sizes

    @property
    def num_users(self) -> int:
        """All user ids, held-out ones included (``generate``'s rule)."""
        return self.num_clients + (self.num_clients - 1) // 9 + 1

    def client_id(self, user: int) -> str:
        """The zero-padded id ``generate`` stores for ``user``."""
        return f"{user:0{max(8, len(str(self.num_users - 1)))}d}"

    @staticmethod
    def train_user(client: int) -> int:
        """The user id of the ``client``-th train user (ids ``u % 10 == 0`` skipped)."""
        return client + client // 9 + 1

    def draws(self, user: int, *, first_only: bool = False) -> list[tuple[str, _Draws]]:
        """The user's draws per split, exactly those ``generate`` renders (``first_only``: its ``train`` or
        ``heldout`` block alone, the ``test`` block not drawn)."""
        if not 0 <= user < self.num_users:
            raise IndexError(f"user {user} outside 0..{self.num_users - 1}")
        return _user_draws(self.seed, user, _world(self.seed),
                           _sizes(self.min_examples, self.mean_examples, self.max_examples), first_only=first_only)

    def split_users(self, split: str) -> Iterator[int]:
        """Candidate user ids of a split in id order (``test``: the train users, of which some have no test block)."""
        if split == "heldout":
            return iter(range(0, self.num_users, 10))
        if split in ("train", "test"):
            return (self.train_user(i) for i in range(self.num_clients))
        raise ValueError(f"unknown split {split!r}; splits are ['train', 'heldout', 'test']")

    def describe(self) -> dict[str, object]:
        """The generator's arguments (for provenance and the count folder's marker)."""
        return {"generator": "fedprivacy.data.synthetic (on demand)", "num_clients": self.num_clients,
                "seed": self.seed, "min_examples": self.min_examples, "mean_examples": self.mean_examples,
                "max_examples": self.max_examples, "count_users": min(self.num_clients, COUNT_SAMPLE_USERS)}


def count_paths(population: OnDemandPopulation, root: Path) -> tuple[Path, Path]:
    """Where :func:`count_files` keeps the population's two count files under ``root``."""
    p = population
    folder = Path(root) / (f"on-demand-seed{p.seed}-users{min(p.num_clients, COUNT_SAMPLE_USERS)}-sizes"
                           f"{p.min_examples}-{p.mean_examples:g}-{p.max_examples}")
    return folder / WORD_COUNT_NAME, folder / TAG_COUNT_NAME


def count_files(population: OnDemandPopulation, root: Path) -> tuple[Path, Path]:
    """``stackoverflow.word_count`` and ``stackoverflow.tag_count`` of the population's first
    ``min(num_clients, COUNT_SAMPLE_USERS)`` train users, written once under ``root`` (in a folder
    named for the seed, the sizes and the users counted) and reused afterwards."""
    p = population
    counted = min(p.num_clients, COUNT_SAMPLE_USERS)
    words, tags = count_paths(p, root)
    if words.is_file() and tags.is_file():
        return words, tags
    folder = words.parent
    folder.mkdir(parents=True, exist_ok=True)
    word_counts = np.zeros(VOCAB_SIZE, dtype=np.int64)
    tag_counts = np.zeros(NUM_TAGS, dtype=np.int64)
    for client in range(counted):
        [(_, draws)] = p.draws(p.train_user(client), first_only=True)   # the train block
        _add_counts(word_counts, tag_counts, draws.tokens, draws.example_tags())
    partial = {path: path.with_name(f"{path.name}.{os.getpid()}.partial") for path in (words, tags)}
    _write_counts(_world(p.seed), word_counts, tag_counts, partial[words], partial[tags])
    for path, temporary in partial.items():
        os.replace(temporary, path)
    (folder / "on_demand.json").write_text(json.dumps(p.describe()))
    return words, tags


class TagRows:
    """Drawn blocks -> tag-prediction CSR pieces, through rank -> column lookup arrays.

    ``word_column[r]`` is the feature column of the word of background rank ``r`` (its position
    among the first ``vocab_size`` words of the word count file), -1 outside; ``tag_column``
    likewise for the tags (first ``num_tags`` of the tag count file).
    """

    def __init__(self, seed: int, word_count: Path, tag_count: Path, *, vocab_size: int, num_tags: int,
                 no_tag: NoTag):
        if vocab_size < 1 or num_tags < 1:
            raise ValueError(f"vocab_size and num_tags must be >= 1, got {vocab_size}, {num_tags}")
        if no_tag not in ("label0", "drop"):
            raise ValueError(f"no_tag must be 'label0' or 'drop', got {no_tag!r}")
        world = _world(seed)
        self.vocab_size, self.num_tags, self.no_tag = vocab_size, num_tags, no_tag
        self.word_column = _columns(world.words, read_word_counts(word_count, vocab_size), word_count)
        self.tag_column = _columns(world.tags, list(read_tag_counts(tag_count))[:num_tags], tag_count)

    def rows(self, draws: _Draws) -> _ClientRows:
        """The CSR pieces of one block, identical to preprocessing its rendered examples."""
        post_of, num_posts = draws.post_of, draws.num_posts
        # Tags: each post's in-vocabulary columns, sorted; label = the smallest (0 if none).
        columns = self.tag_column[draws.tag_ids]
        owner = np.repeat(np.arange(num_posts), np.diff(draws.tag_offsets))
        known = columns >= 0
        order = np.lexsort((columns[known], owner[known]))
        post_columns, post_owner = columns[known][order], owner[known][order]
        post_nnz = np.bincount(post_owner, minlength=num_posts)
        post_start = np.cumsum(post_nnz) - post_nnz
        tagged = post_nnz > 0
        post_label = np.zeros(num_posts, dtype=np.int64)
        post_label[tagged] = post_columns[post_start[tagged]]
        kept = np.flatnonzero(tagged[post_of]) if self.no_tag == "drop" else np.arange(len(post_of))
        posts = post_of[kept]
        n = len(kept)

        # Words: every sentence's tokens, then its post's title, by sentence; the kept sentences renumbered 0..n-1.
        title_len = draws.title_len[post_of]
        title_rows, title_idx = _expand((np.cumsum(draws.title_len) - draws.title_len)[post_of], title_len)
        ids = np.concatenate([self.word_column[draws.tokens], self.word_column[draws.title][title_idx]])
        rows = np.concatenate([np.repeat(np.arange(len(post_of)), draws.sentence_len), title_rows])
        counted = ids >= 0
        if n < len(post_of):
            row_of = np.full(len(post_of), -1)
            row_of[kept] = np.arange(n)
            rows = row_of[rows]
            counted &= rows >= 0
        keys, counts = _counted(rows[counted] * self.vocab_size + ids[counted])
        key_rows = keys // self.vocab_size
        lengths = (draws.sentence_len + title_len)[kept].astype(np.float64)

        _, tag_idx = _expand(post_start[posts], post_nnz[posts])
        return _ClientRows(row_nnz=np.bincount(key_rows, minlength=n),
                           columns=(keys % self.vocab_size).astype(np.int32),
                           values=(counts / lengths[key_rows]).astype(np.float32),
                           labels=post_label[posts].astype(np.int64),
                           tag_nnz=post_nnz[posts].astype(np.int64),
                           tag_columns=post_columns[tag_idx].astype(np.int32),
                           dropped=len(post_of) - n)


def _columns(names: np.ndarray, vocabulary: Sequence[str], path: Path) -> np.ndarray:
    """Rank -> position of the name in ``vocabulary`` (-1 if absent), for the generator's names (int32: the lookups
    gather from it at random, and half the bytes stay in cache)."""
    rank = {name: r for r, name in enumerate(names.tolist())}
    column = np.full(len(names), -1, dtype=np.int32)
    for j, name in enumerate(vocabulary):
        if name not in rank:
            raise ValueError(f"{path}: {name!r} is not a word or tag of the synthetic generator")
        column[rank[name]] = j
    return column


def _counted(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_counts=True)`` for keys made of ascending runs (a block's rows, then its title rows).

    A stable sort (timsort) merges the runs instead of sorting from scratch: about five times faster here.
    """
    keys = np.sort(keys, kind="stable")
    first = np.empty(len(keys), dtype=bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return keys[starts], np.diff(starts, append=len(keys))


def _expand(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges ``starts[k]:starts[k] + lengths[k]``: each element's range ``k`` and its index."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    ends = np.cumsum(lengths)
    return rows, np.arange(ends[-1] if len(ends) else 0) - np.repeat(ends - lengths - starts, lengths)


class OnDemandTags:
    """Tag-prediction rows of an :class:`OnDemandPopulation`'s users, generated when asked for.

    ``client(i)`` is train user ``i``'s :class:`FederatedTagData` (one client; at most its first
    ``max_examples_per_client`` posts), generated in the caller's thread: nothing is held between
    calls, so memory follows the client being trained. (Generating a round's cohort ahead in a
    background thread was measured and gave no gain on the 2-core machine: BENCHMARKS.md.)
    """

    def __init__(self, population: OnDemandPopulation, rows: TagRows, *, num_clients: int,
                 max_examples_per_client: int | None = None):
        self.population, self.rows = population, rows
        self.num_clients = num_clients
        self.vocab_size, self.num_tags = rows.vocab_size, rows.num_tags
        self.max_examples_per_client = max_examples_per_client

    def client(self, client: int) -> FederatedTagData:
        """Client ``client``'s rows (train user ``client``), freshly generated."""
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client {client} outside 0..{self.num_clients - 1}")
        user = self.population.train_user(client)
        [(_, draws)] = self.population.draws(user, first_only=True)
        data = assemble([(self.population.client_id(user), self.rows.rows(draws))], self.vocab_size, self.num_tags)
        cap = self.max_examples_per_client
        if cap is None or data.offsets[-1] <= cap:
            return data
        return FederatedTagData(features=data.features[:cap], labels=data.labels[:cap], tags=data.tags[:cap],
                                offsets=np.array([0, cap]), client_ids=data.client_ids,
                                vocab_size=self.vocab_size, num_tags=self.num_tags, num_dropped=data.num_dropped)

    def split(self, split: str, *, first_users: int | None = None,
              max_examples: int | None = None) -> FederatedTagData:
        """Users of ``heldout`` or ``test`` in id order: the first ``first_users`` of them, or as many
        as it takes to reach ``max_examples`` rows (the rows beyond are kept; cut them after)."""
        parts, rows_so_far = [], 0
        for user in self.population.split_users(split):
            if (first_users is not None and len(parts) >= first_users) or (
                    max_examples is not None and rows_so_far >= max_examples):
                break
            for name, draws in self.population.draws(user):
                if name == split:
                    parts.append((self.population.client_id(user), self.rows.rows(draws)))
                    rows_so_far += len(parts[-1][1].labels)
        return assemble(parts, self.vocab_size, self.num_tags)


def generated_population(source: ExampleSource) -> OnDemandPopulation | None:
    """The population :func:`~fedprivacy.data.synthetic.generate` wrote into ``source``'s folder, if every file it
    wrote (examples and counts) still has the identity the marker recorded and the first train client's rows drawn
    from the marker's arguments equal its rows decoded from the files (a marker edited by hand is not trusted);
    None otherwise (real data, changed files, a marker of an older fedprivacy or of another format)."""
    try:
        args = json.loads((source.folder / SYNTHETIC_MARKER).read_text())
        files = args["files"]
        expected = {path.name for path in (source.split_file("train"), *(source.split_file(s) for s in ("heldout", "test")),
                                           source.word_count, source.tag_count)}
        if args["format"] != source.format or not isinstance(files, dict) or set(files) != expected or any(
                written_identity(source.folder / name) != identity for name, identity in files.items()):
            return None
        population = OnDemandPopulation(int(args["num_clients"]), int(args["seed"]), int(args["min_examples"]),
                                        float(args["mean_examples"]), int(args["max_examples"]))
        first = source.client_ids("train")[:1]
        if not first:
            return None
        decoded = next(iter_tag_rows(source, source.word_count, source.tag_count, "train", vocab_size=VOCAB_SIZE,
                                     num_tags=NUM_TAGS, no_tag="label0", clients=first))[1]
        drawn = next(generated_tag_rows(population, source, "train", first, vocab_size=VOCAB_SIZE,
                                        num_tags=NUM_TAGS, no_tag="label0"))[1]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    same = all(np.array_equal(getattr(decoded, f), getattr(drawn, f)) for f in
               ("row_nnz", "columns", "values", "labels", "tag_nnz", "tag_columns")) and decoded.dropped == drawn.dropped
    return population if same else None


def generated_tag_rows(population: OnDemandPopulation, source: ExampleSource, split: str, clients: Sequence[str],
                       *, vocab_size: int, num_tags: int, no_tag: NoTag) -> Iterator[tuple[str, _ClientRows]]:
    """``(client_id, CSR pieces)`` of ``clients`` (ids of ``split`` in ``source``, which ``population`` wrote:
    :func:`generated_population`) drawn, not decoded: what :func:`~fedprivacy.data.tag_prediction.iter_tag_rows`
    yields from the files, in the same order. A ``train`` or ``heldout`` user's ``test`` block, which follows in its
    stream, is not drawn."""
    rows = TagRows(population.seed, source.word_count, source.tag_count, vocab_size=vocab_size, num_tags=num_tags,
                   no_tag=no_tag)
    for client in clients:
        blocks = dict(population.draws(int(client), first_only=split != "test"))  # train, heldout: the first block
        if split not in blocks:
            raise ValueError(f"client {client!r} has no {split} examples in the generator's draws")
        yield client, rows.rows(blocks[split])
