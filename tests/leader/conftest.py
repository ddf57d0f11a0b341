"""Fixtures shared by the leader tests (helpers live in tests/support/leader_sim.py)."""

from __future__ import annotations

import pytest
from leader_sim import Sim, assert_no_leak


@pytest.fixture
def make_sim():
    """Sim factory; after the test every sequence is aborted and no block may be held."""
    sims: list[Sim] = []

    def factory(*args, sim_class: type[Sim] = Sim, **kwargs) -> Sim:
        sims.append(sim_class(*args, **kwargs))
        return sims[-1]

    yield factory
    for sim in sims:
        sim.drain()
        sim.check_ref_counts()
        assert_no_leak(sim.kv)
