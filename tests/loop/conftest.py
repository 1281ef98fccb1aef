"""Fixtures for the loop tests: the fake provider server on a loopback port."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # fake_providers, importable by name

from fake_providers import FakeProviderServer  # noqa: E402


@pytest.fixture
async def fake_server(nursery):
    server = FakeProviderServer()
    await nursery.start(server.serve)
    yield server
