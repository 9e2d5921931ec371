-- The order a recipient's held messages were decided in (src/act/held.rs): a digest lists them
-- in it and is named by the oldest. Neither held_at (the decision instant, equal for messages
-- decided within one clock tick) nor the row id (taken when each hold commits, which
-- concurrent deliveries do in any order) kept it: a digest of 20 listed n-1, n-9, n-10, n-2...
-- A number the worker takes while the message holds its recipient's turn, rising within a
-- worker process; items held at the same instant are in its order.
ALTER TABLE digest_items ADD COLUMN held_order BIGINT NOT NULL DEFAULT 0;

DROP INDEX digest_items_by_group;
CREATE INDEX digest_items_by_group ON digest_items (recipient, rule, group_key, held_at, held_order, id)
    WHERE digest_id IS NULL;
