-- Retention (SPEC §5 "retention", service/prune.py). Additive: no existing column or index
-- changes, so a daemon of the previous release keeps running against this schema.
--
-- Every prune batch is "the oldest N rows past the cutoff": each index below makes that an
-- index range scan that starts at the oldest row and stops after N, whatever the size of
-- the table. Partial where the table holds rows that are never pruned (IN_PROGRESS claims,
-- unpublished results, unreplayed dead letters), so those never cost the pruner a visit.

CREATE INDEX IF NOT EXISTS modifications_prune_idx
    ON modifications (completed_at) WHERE status = 'COMPLETED';

-- A completed request whose id a dead letter carries is kept while the letter is
-- unreplayed or recently replayed (see prune.py: `dlq replay` of that letter must still
-- meet its request and be a duplicate). The pruner asks this once per candidate row: an
-- index probe, whatever the statistics say. A hash index: a dead letter's request_id may
-- be far longer than a btree entry can hold (request_id_too_long keeps it as sent).
CREATE INDEX IF NOT EXISTS dead_letters_request_idx ON dead_letters USING hash (request_id);
CREATE INDEX IF NOT EXISTS dead_letters_prune_idx
    ON dead_letters (replayed_at) WHERE replayed_at IS NOT NULL;

-- Counts of a request that stopped coming back (SQS retention ran out while it failed).
CREATE INDEX IF NOT EXISTS retry_attempts_prune_idx ON retry_attempts (updated_at);

CREATE INDEX IF NOT EXISTS workers_prune_idx ON workers (heartbeat_at);

CREATE INDEX IF NOT EXISTS reconciliation_runs_prune_idx ON reconciliation_runs (finished_at);

CREATE INDEX IF NOT EXISTS outbox_prune_idx ON outbox (published_at) WHERE published_at IS NOT NULL;

-- Reconciliation stays exact on pruned tables: per entity, the winner (highest version;
-- on a tie the one completed first, then the lowest id — transforms.replay_entities'
-- order) among the entity.upsert/entity.delete modifications pruned so far. Written by the
-- pruner in the very transaction that deletes them; the reconcile job replays entity
-- state from these rows plus the modifications still present. The winner of a union is
-- the winner of the winners, so the replay is the same as over the whole history.
-- data_md5 is md5 of the payload's `data` as jsonb text, as the job computes it.
CREATE TABLE entity_checkpoints (
    entity_id        text PRIMARY KEY,
    modification_id  bigint NOT NULL,
    request_id       text NOT NULL,
    request_type     text NOT NULL,
    version          bigint,
    data_md5         text,
    completed_at     timestamptz NOT NULL
);
