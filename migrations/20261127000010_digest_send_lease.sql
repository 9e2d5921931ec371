-- The lease of a digest being sent (src/digest.rs, SEND_LEASE): until this instant, on
-- Postgres's clock, one worker is publishing the digest these items are bound to, and the others
-- leave it alone. A lock held across the publish was not enough: a worker whose Postgres session
-- was lost mid-publish lost its lock with it, and another worker sent the digest too. NULL: not
-- being sent (or its sender's publish failed and it let go).
ALTER TABLE digest_items ADD COLUMN sending_until TIMESTAMPTZ;
