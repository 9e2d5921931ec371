-- A denial event is (recipient, message id, rule, replay): message ids are unique per
-- recipient, so `shared-7` to carol and `shared-7` to dave are two messages. Keyed without the
-- recipient, dave's denial counted as carol's already recorded, and his message was acked with
-- no row and no dispatch.
ALTER TABLE denial_events ADD COLUMN recipient TEXT;
UPDATE denial_events e SET recipient = d.recipient
FROM denials d
WHERE d.message_id = e.message_id AND d.rule = e.rule AND COALESCE(d.replay_of, 0) = e.replay_of;
-- Events whose rows a prune already dropped: no row is left to name them.
UPDATE denial_events SET recipient = '' WHERE recipient IS NULL;
ALTER TABLE denial_events ALTER COLUMN recipient SET NOT NULL;
ALTER TABLE denial_events DROP CONSTRAINT denial_events_pkey;
ALTER TABLE denial_events ADD PRIMARY KEY (recipient, message_id, rule, replay_of);

-- As in 20261122000003_denial_events.sql, with the recipient in the claimed key and the result.
DROP FUNCTION denials_insert(TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], BOOLEAN[],
    TIMESTAMPTZ[], JSONB[], TIMESTAMPTZ[], BIGINT[]);
CREATE FUNCTION denials_insert(
    message_ids  TEXT[],
    recipients   TEXT[],
    channels     TEXT[],
    categories   TEXT[],
    rules        TEXT[],
    kinds        TEXT[],
    reasons      TEXT[],
    shadows      BOOLEAN[],
    retry_afters TIMESTAMPTZ[],
    messages     JSONB[],
    denied_ats   TIMESTAMPTZ[],
    replay_ofs   BIGINT[]
) RETURNS TABLE (inserted_recipient TEXT, inserted_message_id TEXT, inserted_rule TEXT,
    inserted_replay_of BIGINT)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH batch AS (
        SELECT * FROM unnest(message_ids, recipients, channels, categories, rules, kinds,
            reasons, shadows, retry_afters, messages, denied_ats, replay_ofs)
            AS t(message_id, recipient, channel, category, rule, kind, reason, shadow,
                 retry_after, message, denied_at, replay_of)
    ), claimed AS (
        INSERT INTO denial_events (recipient, message_id, rule, replay_of, denied_at)
        SELECT recipient, message_id, rule, COALESCE(replay_of, 0), denied_at FROM batch
        ORDER BY 1, 2, 3, 4
        ON CONFLICT DO NOTHING
        RETURNING recipient, message_id, rule, replay_of
    )
    INSERT INTO denials (message_id, recipient, channel, category, rule, kind, reason,
        shadow, retry_after, message, denied_at, replay_of)
    SELECT b.message_id, b.recipient, b.channel, b.category, b.rule, b.kind, b.reason,
        b.shadow, b.retry_after, b.message, b.denied_at, b.replay_of
    FROM batch b JOIN claimed c ON c.recipient = b.recipient AND c.message_id = b.message_id
        AND c.rule = b.rule AND c.replay_of = COALESCE(b.replay_of, 0)
    RETURNING denials.recipient, denials.message_id, denials.rule, denials.replay_of;
END $$;
