"""The gateway in process (FastAPI's TestClient) against a fake leader that records what
it submits (tests/support/fake_leader.py)."""

from __future__ import annotations

import pytest
from fake_leader import FakeLeader


@pytest.fixture
def leader_model() -> str:
    """The tiny preset whose path (and so tokenizer) the fake leader reports; a module
    overrides it."""
    return "qwen3"


@pytest.fixture
def leader(tiny, leader_model):
    fake = FakeLeader(tiny(leader_model))
    yield fake
    fake.close()


@pytest.fixture
def gateway(leader):
    """gateway(**GatewayConfig fields) -> an open TestClient on a fresh app."""
    from fastapi.testclient import TestClient

    from nvllm.launch.openai.app import GatewayConfig, create_app

    clients = []

    def make(**cfg) -> TestClient:
        c = TestClient(create_app(GatewayConfig(leader.endpoint, "fake", **cfg)))
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)
