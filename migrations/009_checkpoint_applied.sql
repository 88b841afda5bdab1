-- Version ties inside one batch (issue 43). Two requests for one entity with the same
-- version, completed by one statement, share `completed_at`; the handler applied the
-- first in batch order, which need not be the lower id. The replay and the pruner's
-- checkpoints break such a tie by what was applied (`result->>'applied'`), so a checkpoint
-- keeps that too. NULL: not known (a checkpoint written before this column, a row whose
-- result carries no `applied`), ranked between applied and not applied.
-- Additive: a daemon of the previous release keeps running against this schema.
ALTER TABLE entity_checkpoints ADD COLUMN IF NOT EXISTS applied boolean;
