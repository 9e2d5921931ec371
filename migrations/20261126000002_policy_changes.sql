-- Every rule change a running worker applied (SIGHUP or `POST /v1/rules/reload`), written
-- before the new rules run: no change goes unaudited. `source` is 'signal' or
-- 'api:<token name>' (never the token); the hashes are SHA-256 of the policy as `config check`
-- prints it; `diff` is one line per change, for people (`sendquota rules history`). A reload
-- that changes nothing writes no row. Each worker process records its own reload, so a fleet
-- reloaded together writes one row per worker.
CREATE TABLE policy_changes (
    id         BIGSERIAL   PRIMARY KEY,
    changed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    source     TEXT        NOT NULL,
    old_hash   TEXT        NOT NULL,
    new_hash   TEXT        NOT NULL,
    diff       TEXT        NOT NULL
);
