#!/bin/sh
# Lets the replica stream from the primary (initdb allows replication from 127.0.0.1 only).
# Trust, as the rest of this compose file: use scram-sha-256 and a replication role in production.
set -e
echo "host replication all all trust" >> "$PGDATA/pg_hba.conf"
