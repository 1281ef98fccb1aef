"""Fixtures for the loop tests: the fake provider server on a loopback port."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # fake_providers, importable by name

from fake_providers import FakeProviderServer, ThinkingServer  # noqa: E402


@pytest.fixture
async def fake_server(nursery):
    server = FakeProviderServer()
    await nursery.start(server.serve)
    yield server


@pytest.fixture
async def server(nursery):
    """The fake provider server that also streams extended thinking (Anthropic dialect)."""
    s = ThinkingServer()
    await nursery.start(s.serve)
    yield s


@pytest.fixture(params=["memory", "lmdb"])
def kv_url(request, tmp_path):
    """Each test on both engines: the memory one and the durable one on a temporary directory."""
    return "memory:" if request.param == "memory" else f"lmdb:{tmp_path / 'data'}"
