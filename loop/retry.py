"""When to try a model call again, and how long to wait first.

The policy is a plain value (it is stored with nothing and decides nothing
by itself); the loop asks it two questions: :meth:`RetryPolicy.should_retry`
(is this error, at this retry number, after this much output, worth another
try?) and :meth:`RetryPolicy.delay` (how long to wait).  Keeping the answers
pure makes backoff testable on a virtual clock and replayable in ``sim/``:
the jitter comes from a ``random.Random`` the caller may seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .errors import ContextOverflowError, ProviderError, StreamBrokenError, TransientProviderError

__all__ = ["RetryPolicy", "DEFAULT_RETRY_POLICY", "MAX_RETRIES_LIMIT"]

# No policy may ask for more than this many retries of one model call: a run
# stuck in retries must still end (promise 4 bounds attempts, this bounds calls).
MAX_RETRIES_LIMIT = 100


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, honouring ``retry-after``.

    Defaults (DESIGN.md promise 8 / issue 4): 3 retries, from 2 s doubling,
    each delay jittered by +-``jitter`` (a fraction) and capped at
    ``max_delay``.  A server's ``retry-after`` replaces the computed delay when
    it is longer (never shorter: backing off *less* than our own schedule
    because a server said "1 s" would defeat the exponential).
    """

    max_retries: int = 3
    initial_delay: float = 2.0
    multiplier: float = 2.0
    max_delay: float = 60.0
    jitter: float = 0.2
    # Context overflow gets exactly this many compactions per model call.
    max_compactions: int = 1
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        assert 0 <= self.max_retries <= MAX_RETRIES_LIMIT, self.max_retries
        assert self.initial_delay >= 0 and self.multiplier >= 1 and self.max_delay >= 0
        assert 0 <= self.jitter < 1
        assert self.max_compactions >= 0

    def should_retry(self, error: BaseException, retries_done: int, *, output_started: bool = False) -> bool:
        """Transient errors before any output, while retries remain."""
        if output_started or isinstance(error, StreamBrokenError):
            return False
        if not isinstance(error, TransientProviderError):
            return False
        return retries_done < self.max_retries

    def should_compact(self, error: BaseException, compactions_done: int, *, output_started: bool = False) -> bool:
        return (
            not output_started
            and isinstance(error, ContextOverflowError)
            and compactions_done < self.max_compactions
        )

    def base_delay(self, retry_number: int) -> float:
        """The un-jittered delay before retry ``retry_number`` (1-based)."""
        assert retry_number >= 1
        return min(self.initial_delay * self.multiplier ** (retry_number - 1), self.max_delay)

    def delay(self, retry_number: int, error: ProviderError | None = None) -> float:
        """Seconds to wait before retry ``retry_number`` (1-based)."""
        d = self.base_delay(retry_number)
        if self.jitter:
            d *= 1.0 + self.rng.uniform(-self.jitter, self.jitter)
        d = min(max(d, 0.0), self.max_delay)
        ra = getattr(error, "retry_after", None)
        if ra is not None and ra > d:
            d = float(ra)
        return d


DEFAULT_RETRY_POLICY = RetryPolicy()
