-- A row marked unchecked records a message dispatched without a decision: Redis was
-- unavailable and every rule matching it has on_unavailable = "allow". Like a shadow row it
-- records a dispatch, not a denial, so `replay` never takes it. false for every other row,
-- and for rows from before this migration.
ALTER TABLE denials ADD COLUMN unchecked BOOLEAN NOT NULL DEFAULT false;

-- As in 20261126000001_denial_expires_at.sql, with the unchecked mark.
DROP FUNCTION denials_insert(TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], TEXT[], BOOLEAN[],
    TIMESTAMPTZ[], TEXT[], TIMESTAMPTZ[], BIGINT[], TIMESTAMPTZ[]);
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
    messages     TEXT[],
    denied_ats   TIMESTAMPTZ[],
    replay_ofs   BIGINT[],
    expires_ats  TIMESTAMPTZ[],
    uncheckeds   BOOLEAN[]
) RETURNS TABLE (inserted_recipient TEXT, inserted_message_id TEXT, inserted_rule TEXT,
    inserted_replay_of BIGINT)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    WITH batch AS (
        SELECT * FROM unnest(message_ids, recipients, channels, categories, rules, kinds,
            reasons, shadows, retry_afters, messages, denied_ats, replay_ofs, expires_ats,
            uncheckeds)
            AS t(message_id, recipient, channel, category, rule, kind, reason, shadow,
                 retry_after, message, denied_at, replay_of, expires_at, unchecked)
    ), claimed AS (
        INSERT INTO denial_events (recipient, message_id, rule, replay_of, denied_at)
        SELECT recipient, message_id, rule, COALESCE(replay_of, 0), denied_at FROM batch
        ORDER BY 1, 2, 3, 4
        ON CONFLICT DO NOTHING
        RETURNING recipient, message_id, rule, replay_of
    )
    INSERT INTO denials (message_id, recipient, channel, category, rule, kind, reason,
        shadow, retry_after, message, message_text, denied_at, replay_of, expires_at,
        unchecked)
    SELECT b.message_id, b.recipient, b.channel, b.category, b.rule, b.kind, b.reason,
        b.shadow, b.retry_after, b.message::jsonb, b.message, b.denied_at, b.replay_of,
        b.expires_at, b.unchecked
    FROM batch b JOIN claimed c ON c.recipient = b.recipient AND c.message_id = b.message_id
        AND c.rule = b.rule AND c.replay_of = COALESCE(b.replay_of, 0)
    RETURNING denials.recipient, denials.message_id, denials.rule, denials.replay_of;
END $$;
