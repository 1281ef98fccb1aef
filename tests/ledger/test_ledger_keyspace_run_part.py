"""Session 18: LedgerKeyspace packs a run id once (``_run_part``, cached) for every key of the
run; usage_step is no longer cached. Each key must still be the tuple encoding of its parts,
for any run id (NUL bytes and non-ASCII take kv.tuple's path), whatever was cached before."""

from __future__ import annotations

import kv
from ledger.keyspace import LedgerKeyspace
from ledger.usage import PACKED_LAYOUT


def test_every_run_key_is_the_tuple_encoding_of_its_parts():
    root = kv.Subspace((b"root",))
    keys, base = LedgerKeyspace(root), root["l"]
    for run_id in ("0123456789abcdef", "r\x00un", "é" * 40, "", "r\x00un"):  # (the repeat: cached parts)
        assert keys.run(run_id) == base.pack(("run", run_id))
        assert keys.lease(run_id) == base.pack(("rl", run_id))
        assert keys.cancel(run_id) == base.pack(("cx", run_id))
        assert keys.outcome(run_id).raw_prefix == base.pack(("out", run_id))
        for i in (0, 3, 300):
            assert keys.outcome_chunk(run_id, i) == base.pack(("out", run_id, i))
        for us in (0, 255, 1_700_000_000_000_000):
            assert keys.ready(us, run_id) == base.pack(("rd", us, run_id))
            assert keys.expiry(us, run_id) == base.pack(("lx", us, run_id))
        for step in ("model-1", "compact@3", "s\x00"):
            assert keys.usage_step(run_id, step) == base.pack(("u", run_id, "s", step))
        assert keys.usage_total(run_id, "audio_tokens") == base.pack(("u", run_id, "t", "audio_tokens"))
        assert keys.usage_packed_total(run_id) == base.pack(("u", run_id, "t", PACKED_LAYOUT))
        assert keys.usage_totals_range(run_id).start < keys.usage_packed_total(run_id) < keys.usage_totals_range(run_id).stop
