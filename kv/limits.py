"""Limits of the kv contract, as FoundationDB sets them (known-limitations.rst, ClientKnobs.cpp).

Every backend enforces the same numbers, so a layer that fits on the embedded
engine fits on a cluster.
"""

KEY_SIZE_LIMIT = 10_000            # bytes; larger -> key_too_large (2102) at once
VALUE_SIZE_LIMIT = 100_000         # bytes; larger -> value_too_large (2103) at once
TRANSACTION_SIZE_LIMIT = 10_000_000  # keys + values + clear bounds + conflict ranges -> 2101 at commit
MIN_SIZE_LIMIT = 32                # the smallest size_limit option FoundationDB takes (2006 below)
VERSIONS_PER_SECOND = 1_000_000    # commit versions advance about this fast
MVCC_WINDOW_VERSIONS = 5_000_000   # about 5 s: older read versions are transaction_too_old (1007)
MAX_WATCHES = 10_000               # per database -> too_many_watches (1032)
MAX_BATCH_TRANSACTIONS = 32_767    # the versionstamp's 2-byte batch order must stay below 2**15
MAX_BATCH_BYTES = 64_000_000       # a group-commit batch stops growing past this
SYSTEM_KEY_PREFIX = b"\xff"        # keys >= this are outside the legal range (2004)
DEFAULT_MAX_RETRY_DELAY = 1.0      # seconds; on_error's backoff cap
INITIAL_BACKOFF = 0.01             # seconds; doubles per retry


def check_size_limit(nbytes: int) -> int:
    """The ``size_limit`` transaction option's value, checked as FoundationDB checks it
    (invalid_option_value, 2006, outside [MIN_SIZE_LIMIT, TRANSACTION_SIZE_LIMIT]); every
    backend raises it at the call."""
    from .errors import KVError  # (limits stays importable on its own: errors imports nothing either)

    if not MIN_SIZE_LIMIT <= nbytes <= TRANSACTION_SIZE_LIMIT:
        raise KVError(2006, f"size_limit must be in [{MIN_SIZE_LIMIT}, {TRANSACTION_SIZE_LIMIT:,}]")
    return int(nbytes)
