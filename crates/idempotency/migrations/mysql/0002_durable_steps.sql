-- Durable operations (recovery points): the last point reached, the journal of the steps done,
-- and the request, kept while the operation is unsettled so it can be resumed without the client.
-- One statement, applied whole or not at all; if it was applied but its bookkeeping row was not
-- written (a crash between the two), the runner takes "duplicate column" (1060) as applied.
ALTER TABLE idempotency_keys
    ADD COLUMN recovery_point VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    ADD COLUMN request LONGBLOB NULL,
    ADD COLUMN progress LONGBLOB NULL;
