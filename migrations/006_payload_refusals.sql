-- Unreadable S3 payloads (SPEC §6 "unreadable payloads", issue 20). Additive: a daemon of
-- the previous release keeps running against this schema.
--
-- One row per S3 pointer (`s3://bucket/key`, as modifications.payload_pointer) that S3
-- has refused to serve (403, a disabled KMS key, any non-missing 4xx answer). The first
-- refusal's time is kept here, not in a process: it must survive restarts, other replicas
-- and the fresh copies that replace the message near maxReceiveCount (new message id,
-- same pointer). Once `statement_timestamp() - first_refused_at` passes
-- INGEST_S3_UNREADABLE_AFTER the message is dead-lettered as `payload_unreadable`.
-- A pointer key is at most 1,024 bytes and a bucket 63 characters: the primary key
-- entry always fits a B-tree page. The app role gets SELECT/INSERT/UPDATE/DELETE by the
-- default privileges of deploy/sql/roles.sql (the upsert needs INSERT + UPDATE).
CREATE TABLE IF NOT EXISTS payload_refusals (
    pointer           text PRIMARY KEY,
    first_refused_at  timestamptz NOT NULL DEFAULT statement_timestamp(),
    last_refused_at   timestamptz NOT NULL DEFAULT statement_timestamp(),
    refusals          bigint NOT NULL DEFAULT 1,
    last_error        text
);
CREATE INDEX IF NOT EXISTS payload_refusals_prune_idx ON payload_refusals (last_refused_at);
