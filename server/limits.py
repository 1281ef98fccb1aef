"""Every limit the HTTP server enforces, in one place (asserted, documented in /openapi.json)."""

from __future__ import annotations

KiB = 1024

#: Largest request body read off the wire (the design card's 256 KiB). Bigger -> 413 naming this limit,
#: and the connection is closed rather than drained.
MAX_REQUEST_BYTES = 256 * KiB
#: Largest decoded attachment (192 KiB): base64 of it plus JSON framing still fits the request cap.
MAX_ATTACHMENT_BYTES = 192 * KiB
#: Largest user message text (UTF-8 bytes, all parts). The loop journals the whole user message in one
#: message.added event and the journal refuses events over 90,000 bytes (sessions.journal.MAX_EVENT_BYTES),
#: so a bigger message would be acknowledged and then fail every attempt; it is refused up front (413).
MAX_MESSAGE_BYTES = 64 * KiB
#: Parts in one user message.
MAX_MESSAGE_PARTS = 64
#: Conversation ids are journal/transcript key parts (sessions allows 512 characters).
MAX_CONVERSATION_ID = 512
#: Run ids, call ids, attachment ids, project ids.
MAX_ID = 256
#: Idempotency-Key header (the submission id).
MAX_IDEMPOTENCY_KEY = 255
#: Project names (sessions.projects.MAX_PROJECT_NAME).
MAX_PROJECT_NAME = 256
#: Attachment file names.
MAX_FILENAME = 255
#: Per-owner instructions override.
MAX_INSTRUCTIONS = 32 * KiB
#: Free-text reasons (approval decisions).
MAX_REASON = 4_096
#: Usage ceilings on one submission (ledger.usage.MAX_USAGE_FIELDS, which refuses more).
MAX_USAGE_LIMITS = 32
#: Page sizes of list routes.
DEFAULT_PAGE = 256
MAX_PAGE = 1_000

# Note: base64 of exactly 192 KiB is exactly 256 KiB, so with JSON framing the largest attachment one
# request can carry is a few bytes under 192 KiB; the decoded cap binds for anything sent another way.
assert MAX_ATTACHMENT_BYTES * 4 // 3 == MAX_REQUEST_BYTES
assert 0 < DEFAULT_PAGE <= MAX_PAGE
