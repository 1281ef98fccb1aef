"""tests/sim: the simulator's own tests (determinism, faults, oracle, proof that it bites, bounded CI run).

The simulator runs its own ``trio.run`` per simulated run, so these tests are
plain (synchronous) functions, not trio tests.
"""

import pytest


@pytest.fixture(autouse=True)
def _quiet(quiet_runtime_logs):
    """Every sim test runs with the runtime's logs silenced (tests/conftest.py)."""


@pytest.fixture
def break_submission_hash(monkeypatch):
    """Plant a bug: every submission's request hashes the same (the ledger's conflict check is blind).

    Patches ``ledger.encode_request`` (a request's body and hash in one encoding) where it exists,
    else ``ledger.runs.canonical_hash``."""
    import ledger
    import ledger.runs

    if hasattr(ledger.runs, "encode_request"):
        encode = ledger.runs.encode_request

        def same_hash(delivery, result_schema):
            return encode(delivery, result_schema)[0], "every request looks the same"

        for module in (ledger, ledger.runs):  # (callers reach it through either)
            if hasattr(module, "encode_request"):
                monkeypatch.setattr(module, "encode_request", same_hash)
    else:
        monkeypatch.setattr(ledger.runs, "canonical_hash", lambda request: "every request looks the same")
