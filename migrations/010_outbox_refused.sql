-- Results a destination refuses for good. SQS and SNS answer some entries of a batch with
-- SenderFault=true (a character they do not accept, an attribute over their limits): the
-- same entry is refused on every try, so such a row is marked here instead of being
-- claimed again before every later result for ever. The claim, the pending gauges and the
-- FIFO group order skip it; the pruner deletes it INGEST_RESULTS_RETENTION_DAYS after
-- (011's index).
-- Additive: nullable columns, a catalog change only (ACCESS EXCLUSIVE on outbox for a
-- moment, after migrate's lock_timeout); a daemon of the previous release keeps running.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS refused_at timestamptz,
                   ADD COLUMN IF NOT EXISTS refused_reason text;
