"""Client views over preprocessed rows: which rows of the base arrays each client owns.

The preprocessed split (:mod:`fedprivacy.data.tag_prediction`, :mod:`fedprivacy.data.next_word`)
stores a user's posts as one contiguous row range ``offsets[u]:offsets[u + 1]``, in the
source's order. A :class:`Partition` gives client ``i`` the range ``starts[i]:stops[i]``, so
every view below is two small integer arrays over the same (possibly memory-mapped) base
arrays, and no post is copied:

* :func:`natural`: client ``i`` = user ``i`` (TFF's partition by user), optionally capped to
  its first ``cap`` posts (TFF's ``ClientSpec.max_elements`` takes the first ``max_elements``
  after a per-round shuffle; here the cap is deterministic, by position);
* :func:`split_by_position`: each user's first ``floor(f * n_u)`` posts form its train part and
  the rest its test part (AdaDPS: f = 0.8 on the first 400 users);
* :func:`sample_clients`: a uniform subset of users, without replacement, seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Partition", "natural", "split_by_position", "sample_clients"]


@dataclass(frozen=True)
class Partition:
    """Client ``i`` owns base rows ``starts[i]:stops[i]`` (int64 arrays, possibly empty ranges)."""

    starts: np.ndarray
    stops: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.starts)

    @property
    def sizes(self) -> np.ndarray:
        return self.stops - self.starts

    def rows(self) -> np.ndarray:
        """All owned rows, client by client (int64)."""
        sizes = self.sizes
        return (np.repeat(self.starts - np.r_[0, np.cumsum(sizes)[:-1]], sizes)
                + np.arange(int(sizes.sum())))

    def capped(self, cap: int | None) -> Partition:
        """Each client keeps at most its first ``cap`` rows (``None``: unchanged)."""
        if cap is None:
            return self
        return Partition(self.starts, np.minimum(self.stops, self.starts + cap))


def natural(offsets: np.ndarray) -> Partition:
    """One client per user."""
    offsets = np.asarray(offsets, dtype=np.int64)
    return Partition(offsets[:-1], offsets[1:])


def split_by_position(offsets: np.ndarray, train_fraction: float) -> tuple[Partition, Partition]:
    """Per user: the first ``floor(train_fraction * n_u)`` rows, and the remaining rows."""
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    offsets = np.asarray(offsets, dtype=np.int64)
    starts, stops = offsets[:-1], offsets[1:]
    cut = starts + np.floor(train_fraction * (stops - starts) + 1e-9).astype(np.int64)
    return Partition(starts, cut), Partition(cut, stops)


def sample_clients(num_users: int, k: int, seed: int) -> np.ndarray:
    """``min(k, num_users)`` user indices drawn uniformly without replacement, sorted."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x7573657273]))  # "users"
    return np.sort(rng.choice(num_users, size=min(k, num_users), replace=False))
