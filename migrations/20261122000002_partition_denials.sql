-- Partition the denial history by month (denied_at), so old months are dropped whole
-- (`sendquota prune`) instead of deleted row by row. Partitions are created on demand by the
-- writer (DenialStore::insert) for the month a denial falls in.
--
-- A unique index on a partitioned table must contain the partition key, and a redelivered
-- message is denied again at a later instant, so the one-row-per-event rule is kept by the
-- writer instead: it takes a transaction-level advisory lock on the event key and inserts only
-- when no row for (message_id, rule, replay_of) exists.

ALTER TABLE denials RENAME TO denials_unpartitioned;
ALTER INDEX denials_event RENAME TO denials_unpartitioned_event;
ALTER INDEX denials_recipient_time RENAME TO denials_unpartitioned_recipient_time;
ALTER INDEX denials_rule_time RENAME TO denials_unpartitioned_rule_time;
ALTER INDEX denials_unreplayed RENAME TO denials_unpartitioned_unreplayed;

CREATE TABLE denials (
    id           BIGINT      NOT NULL DEFAULT nextval('denials_id_seq'),
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
    replayed_at  TIMESTAMPTZ,
    replay_of    BIGINT,
    PRIMARY KEY (id, denied_at)
) PARTITION BY RANGE (denied_at);

ALTER SEQUENCE denials_id_seq OWNED BY denials.id;

-- Queries list newest first by id (keyset pagination); a time range prunes whole partitions
-- and is checked on the rows the index yields.
-- The event lookup of the writer (and "every denial of this message").
CREATE INDEX denials_event ON denials (message_id, rule);
-- "Why did this person get no message?"
CREATE INDEX denials_recipient ON denials (recipient, id DESC);
-- "What is this rule refusing?"
CREATE INDEX denials_rule ON denials (rule, id DESC);
-- "What can be replayed now?" (oldest first, due ones)
CREATE INDEX denials_unreplayed ON denials (id) WHERE replayed_at IS NULL AND NOT shadow;

-- Creates the partition holding `at`'s month if it does not exist; returns its name.
CREATE FUNCTION denials_ensure_partition(at TIMESTAMPTZ) RETURNS TEXT
LANGUAGE plpgsql AS $$
DECLARE
    first_day DATE := date_trunc('month', at AT TIME ZONE 'UTC')::date;
    name TEXT := format('denials_y%sm%s', to_char(first_day, 'YYYY'), to_char(first_day, 'MM'));
BEGIN
    EXECUTE format(
        'CREATE TABLE IF NOT EXISTS %I PARTITION OF denials FOR VALUES FROM (%L) TO (%L)',
        name,
        (first_day::timestamp AT TIME ZONE 'UTC'),
        ((first_day + INTERVAL '1 month')::timestamp AT TIME ZONE 'UTC'));
    RETURN name;
END $$;

DO $$
DECLARE month TIMESTAMPTZ;
BEGIN
    FOR month IN SELECT DISTINCT date_trunc('month', denied_at) FROM denials_unpartitioned LOOP
        PERFORM denials_ensure_partition(month);
    END LOOP;
    PERFORM denials_ensure_partition(now());
END $$;

INSERT INTO denials SELECT id, message_id, recipient, channel, category, rule, kind, reason,
    shadow, retry_after, message, denied_at, replayed_at, replay_of FROM denials_unpartitioned;
DROP TABLE denials_unpartitioned;

-- Quota resets done through the admin API, for audit.
CREATE TABLE quota_resets (
    id         BIGSERIAL   PRIMARY KEY,
    recipient  TEXT        NOT NULL,
    actor      TEXT        NOT NULL,
    rules      TEXT[]      NOT NULL,
    keys_removed INTEGER   NOT NULL,
    reset_at   TIMESTAMPTZ NOT NULL
);
CREATE INDEX quota_resets_recipient ON quota_resets (recipient, reset_at DESC);
