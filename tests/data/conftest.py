"""Shared fixtures for the data tests: one small synthetic StackOverflow set."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from fedprivacy.data.synthetic import SyntheticFiles, generate


class SynthSpec(NamedTuple):
    """Arguments the shared synthetic dataset was generated with."""

    num_clients: int
    seed: int


@pytest.fixture(scope="session")
def so_spec() -> SynthSpec:
    """Size and seed of the shared dataset."""
    return SynthSpec(num_clients=60, seed=0)


@pytest.fixture(scope="session")
def so_files(tmp_path_factory: pytest.TempPathFactory, so_spec: SynthSpec) -> SyntheticFiles:
    """A small synthetic dataset, generated once per session."""
    return generate(tmp_path_factory.mktemp("so"), num_clients=so_spec.num_clients,
                    seed=so_spec.seed)


@pytest.fixture(scope="session")
def so_h5_files(tmp_path_factory: pytest.TempPathFactory, so_spec: SynthSpec) -> SyntheticFiles:
    """The same dataset as ``so_files``, written in TFF's legacy HDF5 format."""
    return generate(tmp_path_factory.mktemp("so_h5"), num_clients=so_spec.num_clients,
                    seed=so_spec.seed, format="tff-h5")
