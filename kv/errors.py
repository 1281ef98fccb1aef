"""FoundationDB's error codes, as one exception type.

Every backend raises :class:`KVError` carrying FoundationDB's own code and
name, so code above ``kv`` classifies failures once (``retryable``,
``maybe_committed``) whatever engine is underneath. The classification
mirrors ``fdb_error_predicate`` in ``bindings/c/fdb_c.cpp``.
"""

from __future__ import annotations

__all__ = ["KVError", "ERROR_NAMES", "RETRYABLE_NOT_COMMITTED", "MAYBE_COMMITTED"]

# code -> name, as FoundationDB spells them (flow/include/flow/error_definitions.h).
ERROR_NAMES: dict[int, str] = {
    1007: "transaction_too_old",
    1009: "future_version",
    1020: "not_committed",
    1021: "commit_unknown_result",
    1025: "transaction_cancelled",
    1031: "transaction_timed_out",
    1032: "too_many_watches",
    1034: "watches_disabled",
    1036: "accessed_unreadable",
    1037: "process_behind",
    1038: "database_locked",
    1039: "cluster_version_changed",
    1042: "commit_proxy_memory_limit_exceeded",
    1051: "batch_transaction_throttled",
    1078: "grv_proxy_memory_limit_exceeded",
    1101: "operation_cancelled",
    1213: "tag_throttled",
    1223: "proxy_tag_throttled",
    1235: "transaction_throttled_hot_shard",
    2000: "client_invalid_operation",
    2004: "key_outside_legal_range",
    2005: "inverted_range",
    2006: "invalid_option_value",
    2007: "invalid_option",
    2017: "used_during_commit",
    2021: "no_commit_version",
    2101: "transaction_too_large",
    2102: "key_too_large",
    2103: "value_too_large",
    4000: "unknown_error",
    4100: "internal_error",
}

# on_error resets and retries these; the transaction certainly did not commit.
RETRYABLE_NOT_COMMITTED = frozenset({1007, 1009, 1020, 1037, 1038, 1042, 1051, 1078, 1213, 1223, 1235})
# on_error also retries these, but the transaction may have committed: code
# that can see them must be idempotent (see fdb-semantics.md, "The 1021 guarantee").
MAYBE_COMMITTED = frozenset({1021, 1039})


class KVError(Exception):
    """A FoundationDB error: ``code`` and ``name`` are FoundationDB's own."""

    def __init__(self, code: int, message: str | None = None) -> None:
        self.code = int(code)
        self.name = ERROR_NAMES.get(self.code, "unknown_error")
        self.description = message or self.name
        super().__init__(f"{self.name} ({self.code}): {self.description}" if message else f"{self.name} ({self.code})")

    @property
    def retryable(self) -> bool:
        """``on_error`` would retry this error (it may still have committed)."""
        return self.code in RETRYABLE_NOT_COMMITTED or self.code in MAYBE_COMMITTED

    @property
    def maybe_committed(self) -> bool:
        """The transaction may have committed although the caller saw an error."""
        return self.code in MAYBE_COMMITTED

    @property
    def retryable_not_committed(self) -> bool:
        return self.code in RETRYABLE_NOT_COMMITTED

    def __reduce__(self):  # picklable across processes (crash tests use pipes)
        return (KVError, (self.code, self.description))
