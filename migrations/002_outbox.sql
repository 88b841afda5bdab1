-- Results out (SPEC §5): one row per outcome, written by the very statement that
-- completes or dead-letters a request, and published to SNS/SQS after that commit.
-- Additive: 001's tables are untouched; with results off nothing writes here.
CREATE TABLE outbox (
    id            bigserial PRIMARY KEY,
    request_id    text NOT NULL,
    request_type  text,
    status        text NOT NULL CHECK (status IN ('COMPLETED', 'FAILED')),
    result        jsonb,
    reason        text,
    completed_at  timestamptz NOT NULL DEFAULT now(),
    -- MessageGroupId on a FIFO destination: the source message's group (NULL: a
    -- standard source, the request_id is used).
    group_id      text,
    published_at  timestamptz
);
-- The publisher's claim and the pending/age gauges read only the unpublished rows.
CREATE INDEX outbox_pending_idx ON outbox (id) WHERE published_at IS NULL;
