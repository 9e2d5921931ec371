-- Who replayed a quarantined message: the admin token's name when the console did it, `cli`
-- for `sendquota quarantine replay`. Rows from before this migration name no one.
ALTER TABLE quarantine_replays ADD COLUMN actor TEXT;
