-- Durable operations (recovery points): the last point reached, the journal of the steps done,
-- and the request, kept while the operation is unsettled so it can be resumed without the client.
-- Applied inside the migration's BEGIN IMMEDIATE transaction, with its bookkeeping row.
ALTER TABLE idempotency_keys ADD COLUMN recovery_point TEXT;
ALTER TABLE idempotency_keys ADD COLUMN request BLOB;
ALTER TABLE idempotency_keys ADD COLUMN progress BLOB;
