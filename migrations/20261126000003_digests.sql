-- Messages held by `on_deny = "digest"` rules until the rule has room for one digest of them
-- (src/digest.rs). A held message is not denied (it has no denial row); it leaves this table
-- when its digest has been sent, or as an `expired` denial row once past its deadline.
CREATE TABLE digest_items (
    id           BIGSERIAL PRIMARY KEY,
    recipient    TEXT NOT NULL,
    rule         TEXT NOT NULL,
    -- The value of the rule's digest_by attribute, '' for a rule without one or a message
    -- without it: digests are per (recipient, rule, group_key).
    group_key    TEXT NOT NULL,
    channel      TEXT NOT NULL,
    message_id   TEXT NOT NULL,
    -- The request as a denial row keeps it (SendRequest::to_json_text).
    message_text TEXT NOT NULL,
    -- The message's deadline: past it, it is dropped from its digest and recorded expired.
    expires_at   TIMESTAMPTZ,
    held_at      TIMESTAMPTZ NOT NULL,
    -- The digest the item was admitted into: set in the transaction that saw the limiter admit
    -- the digest, before it is published, so a digest interrupted by a crash is sent again with
    -- exactly these items (and no item held since).
    digest_id    TEXT,
    -- When the rules said the recipient has room again, the last time they refused this group's
    -- digest: the flusher leaves the group until then, so groups without room cannot crowd out
    -- the others. NULL: at the next flush.
    flush_after  TIMESTAMPTZ,
    -- A redelivered copy of a held message is held once.
    UNIQUE (recipient, rule, group_key, message_id)
);

CREATE INDEX digest_items_by_group ON digest_items (recipient, rule, group_key, id)
    WHERE digest_id IS NULL;
CREATE INDEX digest_items_by_digest ON digest_items (digest_id) WHERE digest_id IS NOT NULL;
