-- sqs-ingest: no-transaction
-- The pruner's pick of refused results (010), oldest first; it holds refused rows only.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_refused_idx ON outbox (refused_at)
    WHERE refused_at IS NOT NULL;
