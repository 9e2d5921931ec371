-- A quota reset writes its audit row first, `pending`, deletes the quota, then marks the row
-- `done` (or `failed` when Redis refused): no reset is ever unaudited. Written after the
-- deletion, a failed insert (a lock timeout) left the quota gone and no row saying who did it.
-- A row still `pending` is a reset whose outcome is unknown (the worker or Postgres failed in
-- between); repeating the reset is safe. Rows from before this migration were all done.
ALTER TABLE quota_resets ADD COLUMN status TEXT NOT NULL DEFAULT 'done'
    CHECK (status IN ('pending', 'done', 'failed'));
ALTER TABLE quota_resets ALTER COLUMN status DROP DEFAULT;
ALTER TABLE quota_resets ALTER COLUMN keys_removed DROP NOT NULL;
