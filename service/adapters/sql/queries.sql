-- Named statements of the store. Each block starts with "-- name: <name>".
--
-- Array parameters are text[] — cast here to the type meant ($6::text[]::timestamptz[]):
-- asyncpg encodes text[] by itself, but looks any other array type up in the catalog the
-- first time each connection uses it (a JIT toggle around a query: 3 or 4 round trips per
-- type per connection). tests/unit/test_lint.py keeps it so.

-- name: claim
-- One statement per batch. Input is sorted by request_id so two workers claiming
-- overlapping batches take the unique-index locks in the same order (no deadlock).
-- $8: message attributes (jsonb text or NULL), $9: the S3 pointer the payload came from,
-- $10/$11: FIFO MessageGroupId and SequenceNumber (NULL on a standard queue), $12: the
-- claim token of each message (a release deletes only the row carrying its token).
-- FIFO order (SPEC §6): a message is held — not inserted, `held` — while an earlier message
-- of its group (lower sequence number, another request) is IN_PROGRESS under anyone, dead
-- or alive. Earlier messages of the same batch are the caller's (plan.classify).
-- $13: the worker lease (seconds; NULL: off). A claim of one of these requests whose owner
-- the orphan GC would collect — heartbeat older than the lease, stopped, or no worker row
-- (gc_orphans' rule) — is taken over here, in this statement, instead of waiting for the
-- GC: the message does not spend its receives (FIFO: its group's order) on a dead owner.
-- A live owner's claim is never taken (SPEC §2.6), nor one a completing transaction holds
-- locked (SKIP LOCKED: that owner is alive after all; nothing here ever waits).
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[]::timestamptz[],
                         $8::text[], $9::text[], $10::text[], $11::text[]::numeric[], $12::text[]::uuid[])
        AS t(request_id, request_type, payload, payload_sha256, sqs_message_id, sent_at,
             message_attributes, payload_pointer, group_id, sequence_number, claim_token)
), stale AS (
    SELECT e.id, e.request_id, e.owner FROM modifications e
      JOIN input i ON i.request_id = e.request_id
     WHERE $13::float8 IS NOT NULL
       AND e.status = 'IN_PROGRESS' AND e.owner IS DISTINCT FROM $7
       AND NOT EXISTS (SELECT 1 FROM workers w
                        WHERE w.worker_id = e.owner AND w.stopped_at IS NULL
                          AND w.heartbeat_at >= now() - make_interval(secs => $13))
       AND NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.sqs_message_id = i.sqs_message_id)
), held AS (
    SELECT i.request_id FROM input i
     WHERE i.group_id IS NOT NULL AND i.sequence_number IS NOT NULL
       AND EXISTS (SELECT 1 FROM modifications e
                    WHERE e.status = 'IN_PROGRESS' AND e.group_id = i.group_id
                      AND e.sequence_number < i.sequence_number
                      AND e.request_id <> i.request_id
                      -- an earlier message of this batch whose dead owner's claim is
                      -- taken over below: the caller orders the batch (plan.classify)
                      AND e.id NOT IN (SELECT id FROM stale))
), taken AS (
    UPDATE modifications m
       SET request_type = i.request_type, payload = i.payload::jsonb,
           payload_sha256 = i.payload_sha256, sqs_message_id = i.sqs_message_id, owner = $7,
           sent_at = i.sent_at, received_at = now(),
           message_attributes = i.message_attributes::jsonb,
           payload_pointer = i.payload_pointer, group_id = i.group_id,
           sequence_number = i.sequence_number, claim_token = i.claim_token
      FROM input i, stale s
     WHERE m.id = s.id AND i.request_id = s.request_id
       AND i.request_id NOT IN (SELECT request_id FROM held)
       AND m.id IN (SELECT l.id FROM modifications l WHERE l.id IN (SELECT id FROM stale)
                     ORDER BY l.request_id FOR UPDATE SKIP LOCKED)
       -- rechecked on the row as locked: completed or claimed anew meanwhile, it stays
       AND m.status = 'IN_PROGRESS' AND m.owner IS NOT DISTINCT FROM s.owner
    RETURNING m.request_id, s.owner
), ins AS (
    INSERT INTO modifications
        (request_id, request_type, payload, payload_sha256, status, sqs_message_id, owner, sent_at,
         message_attributes, payload_pointer, group_id, sequence_number, claim_token)
    SELECT request_id, request_type, payload::jsonb, payload_sha256, 'IN_PROGRESS',
           sqs_message_id, $7, sent_at, message_attributes::jsonb, payload_pointer, group_id,
           sequence_number, claim_token
      FROM input
     -- This very SQS message was already dead-lettered (its ack failed or was cut
     -- short): never apply it after the fact.
     WHERE NOT EXISTS (SELECT 1 FROM dead_letters d WHERE d.sqs_message_id = input.sqs_message_id)
       AND input.request_id NOT IN (SELECT request_id FROM held)
       AND input.request_id NOT IN (SELECT request_id FROM stale)
    ON CONFLICT (request_id) DO NOTHING
    RETURNING request_id
)
SELECT i.request_id,
       ins.request_id IS NOT NULL OR t.request_id IS NOT NULL AS claimed,
       m.status, m.request_type, m.payload_sha256, m.owner,
       coalesce(r.failures, 0) AS failures,
       EXISTS (SELECT 1 FROM dead_letters d WHERE d.sqs_message_id = i.sqs_message_id)
           AS dead_lettered,
       -- held only when no claim of its own exists (else: duplicate, conflict, contention)
       h.request_id IS NOT NULL AND m.request_id IS NULL AS held,
       t.owner AS collected_from
  FROM input i
  LEFT JOIN ins ON ins.request_id = i.request_id
  LEFT JOIN taken t ON t.request_id = i.request_id
  LEFT JOIN held h ON h.request_id = i.request_id
  LEFT JOIN modifications m ON m.request_id = i.request_id
  LEFT JOIN retry_attempts r ON r.request_id = i.request_id

-- name: known_pointers
-- The requests claimed with these S3 payload pointers (partial index of migration 003).
SELECT payload_pointer, request_id, request_type, status FROM modifications
 WHERE payload_pointer = ANY($1::text[])

-- name: note_refusals
-- S3 refused to serve these pointers (again): the first refusal's time stays, the rest
-- is updated. Returns how long each has been refused (seconds), measured by the database
-- clock like every other time the daemon keeps. $1 pointers (distinct), $2 errors.
INSERT INTO payload_refusals AS r (pointer, last_error)
SELECT * FROM unnest($1::text[], $2::text[])
    ON CONFLICT (pointer) DO UPDATE
   SET last_refused_at = statement_timestamp(), refusals = r.refusals + 1,
       last_error = excluded.last_error
RETURNING pointer,
          extract(epoch FROM statement_timestamp() - r.first_refused_at)::float8 AS refused_for

-- name: fence
-- Lock this worker's claims before running handlers: GC cannot delete a locked row,
-- and a claim GC already collected is simply not returned (so never completed).
SELECT request_id FROM modifications
 WHERE request_id = ANY($1::text[]) AND owner = $2 AND status = 'IN_PROGRESS'
 ORDER BY request_id
   FOR UPDATE

-- name: guard_commit
-- Run before the handlers: a cursor WITH HOLD runs its query at COMMIT, and an error there
-- fails the COMMIT and rolls the transaction back. It passes once the completing statement
-- (below) has set sqs_ingest.completing; a handler's COMMIT before that commits nothing.
-- concat(), not ||: the setting is NULL until then. Nothing constant in the error branch
-- (the planner would fold it, and fail, at DECLARE). CLOSE ALL first: a guard that passed,
-- or that was run by a COMMIT that then failed on something else, outlives its transaction
-- (a held cursor) until the connection's reset after the batch.
CLOSE ALL;
DECLARE sqs_ingest_commit_guard CURSOR WITH HOLD FOR
SELECT CASE current_setting('sqs_ingest.completing', true) WHEN 'on' THEN 1
       ELSE concat('sqs-ingest: a handler may not end the transaction that completes its batch',
                   current_setting('sqs_ingest.completing', true))::int END

-- name: complete
-- completed_at: when this statement runs, after the handlers (now() would be the start of
-- the transaction): retention counts from it, and a copy of the message sent while the
-- handler worked must not outlive the request's row. set_config: the COMMIT may now pass
-- (guard_commit), for this transaction only.
UPDATE modifications AS m
   SET status = 'COMPLETED', completed_at = statement_timestamp(), result = u.result::jsonb
  FROM unnest($1::text[], $2::text[]) AS u(request_id, result)
 WHERE m.request_id = u.request_id AND m.owner = $3 AND m.status = 'IN_PROGRESS'
RETURNING m.request_id, set_config('sqs_ingest.completing', 'on', true)

-- name: complete_with_result
-- `complete` plus its result row in `outbox`, in the same statement (results on): no
-- commit without its result, no result without its commit. $4: the source group per
-- request (FIFO destination's MessageGroupId), aligned with $1. set_config: as in `complete`.
WITH done AS (
    UPDATE modifications AS m
       SET status = 'COMPLETED', completed_at = statement_timestamp(), result = u.result::jsonb
      FROM unnest($1::text[], $2::text[]) AS u(request_id, result)
     WHERE m.request_id = u.request_id AND m.owner = $3 AND m.status = 'IN_PROGRESS'
    RETURNING m.request_id, m.request_type, m.result, m.completed_at
), out AS (
    INSERT INTO outbox (request_id, request_type, status, result, completed_at, group_id)
    SELECT d.request_id, d.request_type, 'COMPLETED', d.result, d.completed_at, g.group_id
      FROM done d
      JOIN unnest($1::text[], $4::text[]) WITH ORDINALITY AS g(request_id, group_id, n)
        ON g.request_id = d.request_id
     ORDER BY g.n  -- ids in batch order: a FIFO group's results leave in that order
)
SELECT request_id, set_config('sqs_ingest.completing', 'on', true) FROM done

-- name: apply_entities
-- The completing transaction of a batch the reference handlers carry alone (standard queue,
-- no entity twice), fused into one statement, its own transaction: fence, the handlers'
-- upsert (service/handlers/entities.py), complete, clear the failure counts and, with results
-- on ($9), the outbox rows. The fence locks the claims still ours — this owner ($7), this
-- claim's token, IN_PROGRESS — in request_id order until the statement commits; a claim
-- collected or taken over meanwhile is not fenced (rechecked on the row as locked), so
-- neither its entity is written nor its row completed. Only the fenced rows' entities are
-- written, in entity_id order (one lock order for every replica). Per request: applied
-- (its version was newer), as the handler's result {"applied": ...}. $8: the requests with
-- earlier failures (their retry_attempts go, as clear_attempts). No session state is left.
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[]::uuid[], $3::text[], $4::text[]::bigint[], $5::text[]::boolean[],
                         $6::text[], $10::text[])
        WITH ORDINALITY AS t(request_id, claim_token, entity_id, version, deleted, data,
                             group_id, n)
), fenced AS (
    SELECT m.id, m.request_id FROM modifications m, input i
     WHERE m.request_id = i.request_id AND m.claim_token = i.claim_token
       AND m.owner = $7 AND m.status = 'IN_PROGRESS'
     ORDER BY m.request_id
       FOR UPDATE OF m
), up AS (
    INSERT INTO entities AS e (entity_id, version, deleted, data, request_id, updated_at)
    SELECT i.entity_id, i.version, i.deleted, i.data::jsonb, i.request_id, now()
      FROM input i JOIN fenced f ON f.request_id = i.request_id
     ORDER BY i.entity_id
    ON CONFLICT (entity_id) DO UPDATE
       SET version = EXCLUDED.version, deleted = EXCLUDED.deleted, data = EXCLUDED.data,
           request_id = EXCLUDED.request_id, updated_at = now()
     WHERE e.version < EXCLUDED.version
    RETURNING e.request_id
), done AS (
    UPDATE modifications AS m
       SET status = 'COMPLETED', completed_at = statement_timestamp(),
           result = jsonb_build_object('applied', f.request_id IN (SELECT request_id FROM up))
      FROM fenced f
     WHERE m.id = f.id AND m.owner = $7 AND m.status = 'IN_PROGRESS'
    RETURNING m.request_id, m.request_type, m.result, m.completed_at
), cleared AS (
    DELETE FROM retry_attempts r USING done d
     WHERE r.request_id = d.request_id AND r.request_id = ANY($8::text[])
), out AS (
    INSERT INTO outbox (request_id, request_type, status, result, completed_at, group_id)
    SELECT d.request_id, d.request_type, 'COMPLETED', d.result, d.completed_at, i.group_id
      FROM done d JOIN input i ON i.request_id = d.request_id
     WHERE $9::boolean
     ORDER BY i.n  -- ids in batch order, as complete_with_result
)
SELECT d.request_id, (d.result->>'applied')::boolean AS applied FROM done d

-- name: clear_attempts
DELETE FROM retry_attempts WHERE request_id = ANY($1::text[])

-- name: release
-- By (request_id, claim_token): a batch gives back only the claims it made, never a claim
-- another batch of the same worker made for a redelivery of the same SQS message (same
-- MessageId), nor a later claim of the same request when the release comes late.
DELETE FROM modifications m
 USING unnest($1::text[], $3::text[]::uuid[]) AS u(request_id, claim_token)
 WHERE m.request_id = u.request_id AND m.claim_token = u.claim_token
   AND m.owner = $2 AND m.status = 'IN_PROGRESS'
RETURNING m.request_id

-- name: record_failures
INSERT INTO retry_attempts AS r (request_id, failures, last_error, updated_at)
SELECT request_id, 1, err, now() FROM unnest($1::text[], $2::text[]) AS t(request_id, err)
ON CONFLICT (request_id) DO UPDATE
   SET failures = r.failures + 1, last_error = EXCLUDED.last_error, updated_at = now()
RETURNING request_id, failures

-- name: dead_letter
-- Inserted in sqs_message_id order (the conflict key): two replicas dead-lettering the same
-- messages take their unique-index entries in the same order, never a deadlock.
INSERT INTO dead_letters
    (sqs_message_id, body, reason, error, request_id, request_type, receive_count, group_id)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]::int[],
                     $8::text[])
 ORDER BY 1
ON CONFLICT (sqs_message_id) DO NOTHING

-- name: dead_letter_with_result
-- `dead_letter` plus a FAILED result for each row actually inserted (a redelivered
-- poison message is stored once, so it yields one result) that has a request_id, except
-- idempotency_key_reused: that key belongs to another request, whose result it is not.
-- Inserted in sqs_message_id order, as `dead_letter`; the results keep the caller's order.
WITH ins AS (
    INSERT INTO dead_letters
        (sqs_message_id, body, reason, error, request_id, request_type, receive_count, group_id)
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]::int[],
                         $8::text[])
     ORDER BY 1
    ON CONFLICT (sqs_message_id) DO NOTHING
    RETURNING sqs_message_id, request_id, request_type, reason, received_at
)
INSERT INTO outbox (request_id, request_type, status, reason, completed_at, group_id)
SELECT ins.request_id, ins.request_type, 'FAILED', ins.reason, ins.received_at, g.group_id
  FROM ins
  -- DISTINCT: the same message twice in one call is one row of ins, so one result.
  JOIN (SELECT DISTINCT ON (sqs_message_id) * FROM unnest($1::text[], $8::text[])
          WITH ORDINALITY AS u(sqs_message_id, group_id, n)
         ORDER BY sqs_message_id, n) AS g
    ON g.sqs_message_id = ins.sqs_message_id
 WHERE ins.request_id IS NOT NULL AND ins.reason <> 'idempotency_key_reused'
 ORDER BY g.n

-- name: outbox_claim
-- Up to $1 unpublished rows, oldest first, locked until the publisher's transaction ends
-- (sent, then marked): SKIP LOCKED lets replicas share the work and never send a row that
-- another one holds. On a FIFO destination ($2) a row waits while an older row of its group
-- is pending outside this claim (held by another publisher): a group leaves in commit order.
-- A row the destination refused for good (refused_at) is done: never claimed, never waited for.
WITH c AS (
    SELECT id, request_id, request_type, status, result, reason, completed_at, group_id
      FROM outbox
     WHERE published_at IS NULL
       AND refused_at IS NULL
     ORDER BY id
     LIMIT $1
       FOR UPDATE SKIP LOCKED
)
SELECT * FROM c
 WHERE NOT $2::boolean OR c.group_id IS NULL OR NOT EXISTS (
       SELECT 1 FROM outbox o
        WHERE o.published_at IS NULL AND o.refused_at IS NULL
          AND o.group_id = c.group_id AND o.id < c.id
          AND o.id NOT IN (SELECT id FROM c))
 ORDER BY id

-- name: outbox_mark_published
UPDATE outbox SET published_at = now() WHERE id = ANY($1::text[]::bigint[])

-- name: outbox_mark_refused
-- Entries the destination refused for good (SenderFault): $1 ids, $2 what it said of each.
UPDATE outbox o SET refused_at = now(), refused_reason = r.reason
  FROM unnest($1::text[]::bigint[], $2::text[]) AS r(id, reason)
 WHERE o.id = r.id

-- name: outbox_stats
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM now() - min(completed_at)), 0)::float8 AS oldest_age
  FROM outbox WHERE published_at IS NULL AND refused_at IS NULL

-- name: outbox_prune
-- Published rows past their retention, in short batches (never an unpublished row); one of
-- service/adapters/prune.py's steps (INGEST_RESULTS_RETENTION_DAYS).
-- `= ANY(ARRAY(...))`, not `IN (...)`: as a semi-join the planner scans the whole table per
-- batch (1 M rows: 232-246 ms a batch of 5,000 against 18-61 ms; bench/prune_batch_plans.py).
-- Refused rows (refused_at: the destination will never take them) are done too, by
-- migration 011's index.
DELETE FROM outbox
 WHERE id = ANY(ARRAY(SELECT id FROM outbox
                       WHERE published_at < now() - make_interval(secs => $1)
                       ORDER BY published_at LIMIT $2
                         FOR UPDATE SKIP LOCKED)
                || ARRAY(SELECT id FROM outbox
                          WHERE refused_at < now() - make_interval(secs => $1)
                          ORDER BY refused_at LIMIT $2
                            FOR UPDATE SKIP LOCKED))

-- name: register_worker
-- Also how a running worker whose row was pruned comes back (service.runtime.maintenance.beat);
-- a row that exists (stopped or not) is left as it is.
INSERT INTO workers (worker_id, worker_name, hostname, pid) VALUES ($1, $2, $3, $4)
ON CONFLICT (worker_id) DO NOTHING

-- name: heartbeat
UPDATE workers SET heartbeat_at = now() WHERE worker_id = $1 AND stopped_at IS NULL
RETURNING worker_id

-- name: stop_worker
UPDATE workers SET stopped_at = now(), heartbeat_at = now() WHERE worker_id = $1

-- name: release_all
-- At a clean stop: every claim this worker still holds goes back.
DELETE FROM modifications WHERE owner = $1 AND status = 'IN_PROGRESS'
RETURNING request_id

-- name: ping
SELECT 1

-- name: gc_orphans
-- Release claims whose owner is dead: heartbeat older than the lease, stopped, unknown,
-- or an earlier incarnation of a replica with the same explicit name ($3: only passed on
-- the startup pass, NULL afterwards): one that registered before this worker, both times
-- read on the database's clock (a replica's own clock may be off by any amount).
WITH dead AS (
    SELECT worker_id FROM workers
     WHERE worker_id <> $1
       AND (stopped_at IS NOT NULL
            OR heartbeat_at < now() - make_interval(secs => $2)
            OR ($3::text IS NOT NULL AND worker_name = $3
                AND started_at < (SELECT started_at FROM workers WHERE worker_id = $1)))
)
DELETE FROM modifications
 WHERE id IN (
     SELECT m.id FROM modifications m
      WHERE m.status = 'IN_PROGRESS'
        AND m.owner IS DISTINCT FROM $1
        AND (m.owner IN (SELECT worker_id FROM dead)
             OR NOT EXISTS (SELECT 1 FROM workers w WHERE w.worker_id = m.owner))
      ORDER BY m.id
        -- A claim locked by its owner's completing transaction is skipped: that owner
        -- is alive after all, and two replicas' GC passes never deadlock.
        FOR UPDATE SKIP LOCKED)
   AND status = 'IN_PROGRESS'
RETURNING request_id, owner, sqs_message_id

-- name: gc_own_leaks
-- Claims of this very process that no batch holds any more (a batch whose release
-- failed while the database was down).
-- The age margin keeps a claim made after the caller took its snapshot of $2 safe.
DELETE FROM modifications
 WHERE owner = $1 AND status = 'IN_PROGRESS' AND NOT (request_id = ANY($2::text[]))
   AND received_at < now() - interval '30 seconds'
RETURNING request_id

-- name: dlq_list
-- Dead letters (`sqs-ingest dlq`). Listing: filters by reason and time; replayed rows
-- only when asked ($4); up to id $6 (what `replay --all` would send: --dry-run). No
-- locks. A NULL limit ($5) is no limit.
SELECT id, sqs_message_id, body, reason, error, request_id, request_type, receive_count,
       received_at, replayed_at, group_id
  FROM dead_letters
 WHERE ($1::text IS NULL OR reason = $1)
   AND ($2::timestamptz IS NULL OR received_at >= $2)
   AND ($3::timestamptz IS NULL OR received_at < $3)
   AND ($4::boolean OR replayed_at IS NULL)
   AND ($6::bigint IS NULL OR id <= $6)
 ORDER BY id
 LIMIT $5

-- name: dlq_lock_one
-- replayed_at IS NULL is in the locking query on purpose: a session that waited for the
-- lock re-evaluates it on the committed row version and gets no row back.
SELECT id, sqs_message_id, body, reason, error, request_id, request_type, receive_count,
       received_at, replayed_at, group_id
  FROM dead_letters
 WHERE id = $1 AND replayed_at IS NULL
   FOR UPDATE

-- name: dlq_find_one
SELECT id, sqs_message_id, body, reason, error, request_id, request_type, receive_count,
       received_at, replayed_at, group_id
  FROM dead_letters WHERE id = $1

-- name: dlq_lock_batch
-- SKIP LOCKED: concurrent `replay --all` runs split the rows instead of waiting for (and
-- then double-sending) each other's. $2 bounds the run to the rows that existed at its start.
SELECT id, sqs_message_id, body, reason, error, request_id, request_type, receive_count,
       received_at, replayed_at, group_id
  FROM dead_letters
 WHERE replayed_at IS NULL
   AND ($1::text IS NULL OR reason = $1)
   AND ($2::bigint IS NULL OR id <= $2)
 ORDER BY id
 LIMIT $3
   FOR UPDATE SKIP LOCKED

-- name: dlq_max_id
SELECT max(id) FROM dead_letters

-- name: dlq_mark_replayed
UPDATE dead_letters SET replayed_at = now() WHERE id = ANY($1::text[]::bigint[]) RETURNING id

-- Retention (service/adapters/prune.py). Each statement deletes one short batch — the oldest $2
-- rows past the cutoff ($1 seconds before now), by the index migration 004 made for it —
-- and is its own transaction. SKIP LOCKED: a row some session holds is left for the next
-- pass, so the pruner never waits on ingestion; ingestion waits on the pruner only for a
-- row of the batch in flight (a claim of that very request_id), for one batch at most.

-- name: prune_modifications
-- Never IN_PROGRESS. A completed request whose id a dead letter carries is kept while the
-- letter is unreplayed, or was replayed less than $3 seconds ago
-- (INGEST_DEAD_LETTER_RETENTION_DAYS, which exceeds the queue's retention): a replay of it
-- must meet its request (duplicate), not apply it again, also while the replayed copy may
-- still be in the queue. The
-- retry counts of the deleted requests go with them, and the entity checkpoint takes the
-- winner of the deleted entity modifications (same order as transforms.replay_entities:
-- version desc nulls last, applied first (result->>'applied': true, unknown, false; a tie
-- inside one batch shares completed_at), completed_at, id), in the same transaction.
WITH doomed AS (
    SELECT m.id FROM modifications m
     WHERE m.status = 'COMPLETED'
       AND m.completed_at < now() - make_interval(secs => $1)
       AND NOT EXISTS (SELECT 1 FROM dead_letters d
                        WHERE d.request_id = m.request_id
                          AND (d.replayed_at IS NULL
                               OR d.replayed_at >= now() - make_interval(secs => $3)))
     ORDER BY m.completed_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM modifications m USING doomed
     WHERE m.id = doomed.id AND m.status = 'COMPLETED'
    RETURNING m.id, m.request_id, m.request_type, m.payload, m.completed_at, m.result
), retries AS (
    DELETE FROM retry_attempts r USING gone WHERE r.request_id = gone.request_id
    RETURNING r.request_id
), winners AS (
    SELECT DISTINCT ON (entity_id) * FROM (
        SELECT payload->>'entity_id' AS entity_id, id, request_id, request_type,
               CASE WHEN jsonb_typeof(payload->'version') = 'number'
                    THEN (payload->>'version')::numeric::bigint END AS version,
               md5((payload->'data')::text) AS data_md5, completed_at,
               CASE WHEN jsonb_typeof(result->'applied') = 'boolean'
                    THEN (result->>'applied')::boolean END AS applied
          FROM gone
         WHERE request_type IN ('entity.upsert', 'entity.delete')
           AND payload->>'entity_id' IS NOT NULL) g
     ORDER BY entity_id, version DESC NULLS LAST,
              CASE applied WHEN true THEN 0 WHEN false THEN 2 ELSE 1 END, completed_at, id
), checkpoints AS (
    INSERT INTO entity_checkpoints AS c
        (entity_id, modification_id, request_id, request_type, version, data_md5, completed_at,
         applied)
    SELECT entity_id, id, request_id, request_type, version, data_md5, completed_at, applied
      FROM winners
     ORDER BY entity_id
    ON CONFLICT (entity_id) DO UPDATE
       SET modification_id = EXCLUDED.modification_id, request_id = EXCLUDED.request_id,
           request_type = EXCLUDED.request_type, version = EXCLUDED.version,
           data_md5 = EXCLUDED.data_md5, completed_at = EXCLUDED.completed_at,
           applied = EXCLUDED.applied
     WHERE (EXCLUDED.version IS NOT NULL AND (c.version IS NULL OR EXCLUDED.version > c.version))
        OR (EXCLUDED.version IS NOT DISTINCT FROM c.version
            AND (CASE EXCLUDED.applied WHEN true THEN 0 WHEN false THEN 2 ELSE 1 END,
                 EXCLUDED.completed_at, EXCLUDED.modification_id)
                < (CASE c.applied WHEN true THEN 0 WHEN false THEN 2 ELSE 1 END,
                   c.completed_at, c.modification_id))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS modifications,
       (SELECT count(*) FROM retries) AS retry_attempts,
       (SELECT count(*) FROM checkpoints) AS checkpoints

-- name: prune_count_modifications
SELECT count(*) FROM modifications m
 WHERE m.status = 'COMPLETED'
   AND m.completed_at < now() - make_interval(secs => $1)
   AND NOT EXISTS (SELECT 1 FROM dead_letters d
                    WHERE d.request_id = m.request_id
                      AND (d.replayed_at IS NULL
                           OR d.replayed_at >= now() - make_interval(secs => $2)))

-- name: prune_retry_attempts
-- Counts of a request that stopped coming back (its SQS retention ran out while it was
-- failing): older than the retention, it can never be received again.
-- `= ANY(ARRAY(...))`, not `IN (...)`: as a semi-join the planner scans the whole table per
-- batch (1 M rows: 232-246 ms a batch of 5,000 against 18-61 ms; bench/prune_batch_plans.py).
DELETE FROM retry_attempts
 WHERE request_id = ANY(ARRAY(SELECT request_id FROM retry_attempts
                               WHERE updated_at < now() - make_interval(secs => $1)
                               ORDER BY updated_at LIMIT $2
                                 FOR UPDATE SKIP LOCKED))

-- name: prune_count_retry_attempts
SELECT count(*) FROM retry_attempts WHERE updated_at < now() - make_interval(secs => $1)

-- name: prune_dead_letters
-- Replayed ones only: an unreplayed dead letter is kept until somebody looks at it.
-- `= ANY(ARRAY(...))`, not `IN (...)`: as a semi-join the planner scans the whole table per
-- batch (1 M rows: 232-246 ms a batch of 5,000 against 18-61 ms; bench/prune_batch_plans.py).
DELETE FROM dead_letters
 WHERE id = ANY(ARRAY(SELECT id FROM dead_letters
                       WHERE replayed_at < now() - make_interval(secs => $1)
                       ORDER BY replayed_at LIMIT $2
                         FOR UPDATE SKIP LOCKED))

-- name: prune_count_dead_letters
SELECT count(*) FROM dead_letters WHERE replayed_at < now() - make_interval(secs => $1)

-- name: prune_reconciliation_discrepancies
-- Before their runs, in batches: one run can hold many, and the runs' ON DELETE CASCADE
-- would delete them all in one transaction.
DELETE FROM reconciliation_discrepancies
 WHERE id IN (SELECT d.id FROM reconciliation_discrepancies d
               WHERE d.run_id IN (SELECT run_id FROM reconciliation_runs
                                   WHERE finished_at < now() - make_interval(secs => $1))
               LIMIT $2
                 FOR UPDATE SKIP LOCKED)

-- name: prune_count_reconciliation_discrepancies
SELECT count(*) FROM reconciliation_discrepancies d
 WHERE d.run_id IN (SELECT run_id FROM reconciliation_runs
                     WHERE finished_at < now() - make_interval(secs => $1))

-- name: prune_reconciliation_runs
DELETE FROM reconciliation_runs
 WHERE run_id IN (SELECT run_id FROM reconciliation_runs
                   WHERE finished_at < now() - make_interval(secs => $1)
                   ORDER BY finished_at LIMIT $2
                     FOR UPDATE SKIP LOCKED)

-- name: prune_count_reconciliation_runs
SELECT count(*) FROM reconciliation_runs WHERE finished_at < now() - make_interval(secs => $1)

-- name: prune_workers
-- Workers whose last heartbeat is older than the retention (stopped, or died without
-- saying so) and that hold no claim (GC releases those first).
DELETE FROM workers
 WHERE worker_id IN (SELECT w.worker_id FROM workers w
                      WHERE w.heartbeat_at < now() - make_interval(secs => $1)
                        AND NOT EXISTS (SELECT 1 FROM modifications m
                                         WHERE m.owner = w.worker_id
                                           AND m.status = 'IN_PROGRESS')
                      ORDER BY w.heartbeat_at LIMIT $2
                        FOR UPDATE SKIP LOCKED)

-- name: prune_count_workers
SELECT count(*) FROM workers w
 WHERE w.heartbeat_at < now() - make_interval(secs => $1)
   AND NOT EXISTS (SELECT 1 FROM modifications m
                    WHERE m.owner = w.worker_id AND m.status = 'IN_PROGRESS')

-- name: prune_count_outbox
SELECT count(*) FROM outbox
 WHERE published_at < now() - make_interval(secs => $1)
    OR refused_at < now() - make_interval(secs => $1)

-- name: prune_payload_refusals
-- Pointers S3 has not refused for INGEST_RETENTION_DAYS (migration 006's index on
-- last_refused_at). Every refusal moves last_refused_at, so a pointer S3 still refuses is
-- never due. A message whose pointer was last refused that long ago is, as a rule, no
-- longer in the queue (the retention exceeds MessageRetentionPeriod); if it comes back
-- anyway (copies that met only S3 outages meanwhile, a `dlq replay`), its next refusal
-- starts the clock again: a dead letter INGEST_S3_UNREADABLE_AFTER later, nothing lost.
-- `= ANY(ARRAY(...))`, not `IN (...)`: the batch's pointers are then deleted by primary
-- key probes; as a semi-join the planner preferred a whole-table scan per batch (measured
-- on 1 M rows: 0.33 s a batch of 5,000 against 0.02 s).
DELETE FROM payload_refusals
 WHERE pointer = ANY(ARRAY(SELECT pointer FROM payload_refusals
                            WHERE last_refused_at < now() - make_interval(secs => $1)
                            ORDER BY last_refused_at LIMIT $2
                              FOR UPDATE SKIP LOCKED))

-- name: prune_count_payload_refusals
SELECT count(*) FROM payload_refusals
 WHERE last_refused_at < now() - make_interval(secs => $1)
