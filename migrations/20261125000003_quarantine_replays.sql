-- `sendquota quarantine replay` publishes quarantined messages back to the requests exchange
-- once their cause is fixed; each one is recorded here, as replayed denials are marked.
CREATE TABLE quarantine_replays (
    id          BIGSERIAL   PRIMARY KEY,
    message_id  TEXT,
    reason      TEXT        NOT NULL,
    replayed_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
