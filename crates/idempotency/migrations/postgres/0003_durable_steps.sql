-- Durable operations (recovery points): the last point reached, the journal of the steps done,
-- and the request, kept while the operation is unsettled so it can be resumed without the client.
ALTER TABLE idempotency_keys
    ADD COLUMN IF NOT EXISTS recovery_point TEXT,
    ADD COLUMN IF NOT EXISTS request BYTEA,
    ADD COLUMN IF NOT EXISTS progress BYTEA;
