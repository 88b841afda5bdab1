-- The example's own table, created by the handler author's migration (here: applied by the
-- kit's `ingest_schema_sql` fixture in conftest.py, after sqs-ingest's migrations).
CREATE TABLE invoices (
    invoice_id   text PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents bigint NOT NULL CHECK (amount_cents >= 0),
    request_id   text NOT NULL
);
