-- Several workers can find a month's partition missing at once (the month's first denials):
-- CREATE TABLE IF NOT EXISTS is not safe against a concurrent creation of the same table (the
-- second fails with "relation already exists"). Under a transaction-level advisory lock the
-- second waits for the first to commit, then finds the partition there.
CREATE OR REPLACE FUNCTION denials_ensure_partition(at TIMESTAMPTZ) RETURNS TEXT
LANGUAGE plpgsql AS $$
DECLARE
    first_day DATE := date_trunc('month', at AT TIME ZONE 'UTC')::date;
    name TEXT := format('denials_y%sm%s', to_char(first_day, 'YYYY'), to_char(first_day, 'MM'));
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('denials_ensure_partition'));
    EXECUTE format(
        'CREATE TABLE IF NOT EXISTS %I PARTITION OF denials FOR VALUES FROM (%L) TO (%L)',
        name,
        (first_day::timestamp AT TIME ZONE 'UTC'),
        ((first_day + INTERVAL '1 month')::timestamp AT TIME ZONE 'UTC'));
    RETURN name;
END $$;
