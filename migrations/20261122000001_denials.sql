-- One row per denial event: a message refused by a rule (or, with shadow = true, a message a
-- rule on trial would have refused, dispatched anyway).
CREATE TABLE denials (
    id           BIGSERIAL PRIMARY KEY,
    message_id   TEXT        NOT NULL,
    recipient    TEXT        NOT NULL,
    channel      TEXT        NOT NULL,
    category     TEXT        NOT NULL,
    rule         TEXT        NOT NULL,
    kind         TEXT        NOT NULL,
    reason       TEXT        NOT NULL,
    shadow       BOOLEAN     NOT NULL DEFAULT FALSE,
    retry_after  TIMESTAMPTZ,
    message      JSONB       NOT NULL,
    denied_at    TIMESTAMPTZ NOT NULL,
    -- Replay bookkeeping: when this denial's message was published again, and, for a denial of
    -- a replayed message, which denial that replay came from.
    replayed_at  TIMESTAMPTZ,
    replay_of    BIGINT
);

-- A redelivered message is the same event: at most one row per message, rule and replay.
CREATE UNIQUE INDEX denials_event ON denials (message_id, rule, COALESCE(replay_of, 0));
-- "Why did this person get no message?"
CREATE INDEX denials_recipient_time ON denials (recipient, denied_at DESC, id DESC);
-- "What is this rule refusing?"
CREATE INDEX denials_rule_time ON denials (rule, denied_at DESC, id DESC);
-- "What can be replayed now?"
CREATE INDEX denials_unreplayed ON denials (retry_after, id) WHERE replayed_at IS NULL AND NOT shadow;
