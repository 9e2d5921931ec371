-- The per-minute decision rollup the console charts (src/rollup.rs): each worker counts its
-- decisions in memory and adds them here every second with one upsert, never a row per
-- message. `decisions`: decisions of `outcome` recorded under `rule` ('' when no rule made the
-- outcome, as for an allow), so a sum over rules counts each decision once. `verdicts`: how many
-- of those decisions `rule` took part in (more than `decisions` only for dispatches that several
-- shadow rules would have refused). Rows older than 30 days are deleted by the workers.
CREATE TABLE decision_rollup (
    minute    TIMESTAMPTZ NOT NULL,
    outcome   TEXT        NOT NULL,
    rule      TEXT        NOT NULL,
    decisions BIGINT      NOT NULL,
    verdicts  BIGINT      NOT NULL,
    PRIMARY KEY (minute, outcome, rule)
);
