-- FIFO order enforced by the daemon (issue 25, SPEC §6 "FIFO order"). Additive: nullable
-- columns (a catalog change only) and an index over the few IN_PROGRESS rows, so it applies
-- under a running daemon of the previous release.
--
-- A claim of a FIFO queue's message keeps its MessageGroupId and SQS SequenceNumber (a
-- 128-bit decimal). The claim statement holds back a message while an earlier message of its
-- group (lower sequence number) is IN_PROGRESS under anyone, dead or alive.
ALTER TABLE modifications ADD COLUMN group_id text;
ALTER TABLE modifications ADD COLUMN sequence_number numeric(40, 0);
CREATE INDEX IF NOT EXISTS modifications_fifo_in_progress_idx
    ON modifications (group_id, sequence_number)
    WHERE status = 'IN_PROGRESS' AND group_id IS NOT NULL;
