-- Which claim a row is. Additive: a nullable column (a catalog change only), so it applies
-- under a running daemon of the previous release, whose claims simply carry none.
--
-- Every claim statement writes a token of its own (a uuid the daemon draws before it runs
-- the statement), and a release deletes a row only with that token: a batch gives back the
-- claim it made and never one that another batch of the same worker made for a redelivery
-- of the same SQS message (same MessageId), nor, when it releases late (after a database
-- outage), a later claim of the same request.
-- The ALTER takes ACCESS EXCLUSIVE on modifications for a moment; queued behind a long read
-- it would stop every claim behind it, so it gives up after lock_timeout instead (run
-- `sqs-ingest migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE modifications ADD COLUMN IF NOT EXISTS claim_token uuid;
