-- The example's own table. `sqs-ingest migrate` applies this file after sqs-ingest's own
-- migrations (entry point `sqs_ingest.migrations` in pyproject.toml) and records it; never
-- edit it once applied: put a change in 002_*.sql.
CREATE TABLE invoices (
    invoice_id   text PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents bigint NOT NULL CHECK (amount_cents >= 0),
    request_id   text NOT NULL
);
