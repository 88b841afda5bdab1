// The peer of bench/throughput.py's PEER=sqs-consumer phase (issue 26): bbc/sqs-consumer
// (pinned in package.json / package-lock.json) draining the bench's queue into the same
// PostgreSQL tables as the daemon's reference `entity.upsert` handler.
//
//   node peer.mjs   (environment: PEER_QUEUE_URL, PEER_ENDPOINT, PEER_DATABASE_URL,
//                    PEER_CONSUMERS=8, PEER_BATCH_SIZE=10, PEER_STATEMENTS=batch|each,
//                    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION)
//
// PEER_CONSUMERS `Consumer.create` instances share one SQSClient and one pg.Pool (one
// connection per consumer). sqs-consumer 14 has no concurrency option: each Consumer is one
// loop — ReceiveMessage(batchSize, 20 s long poll), handleMessageBatch, DeleteMessageBatch of
// the messages it returns, next receive — so "8 consumers" is 8 batches in flight at most.
//
// handleMessageBatch, in ONE transaction per batch (BEGIN ... COMMIT):
//   1. INSERT INTO modifications (...) status 'COMPLETED', completed_at = statement_timestamp()
//      ON CONFLICT (request_id) DO NOTHING RETURNING request_id — the dedup guard;
//   2. for the requests inserted, the entity upsert of service/handlers/entities.py:
//      INSERT INTO entities ... ON CONFLICT (entity_id) DO UPDATE ... WHERE e.version <
//      EXCLUDED.version, rows in entity_id order.
// PEER_STATEMENTS=batch (default): each step is one statement for the whole batch (unnest
// arrays, as the daemon's claim and batch handler do); =each: two statements per message.
// Per message it also parses the body, checks the envelope by hand (no schema library) and
// hashes the key-sorted payload (payload_sha256), as the daemon does.
// Not done (the daemon does): the separate claim transaction and owner fencing, retries
// and dead letters, heartbeats and visibility extension, metrics, logs, results, FIFO order.
// On SIGTERM: stops every consumer (in-flight long polls aborted), closes the pool and
// prints one JSON line of counters to stdout.
import { createHash } from "node:crypto";

import { SQSClient } from "@aws-sdk/client-sqs";
import pg from "pg";
import { Consumer } from "sqs-consumer";

const env = (name, fallback) => {
  const v = process.env[name];
  if (v === undefined || v === "") {
    if (fallback === undefined) {
      process.stderr.write(`peer: ${name} is required\n`);
      process.exit(2);
    }
    return fallback;
  }
  return v;
};

const QUEUE_URL = env("PEER_QUEUE_URL");
const ENDPOINT = env("PEER_ENDPOINT");
const DATABASE_URL = env("PEER_DATABASE_URL");
const CONSUMERS = Number(env("PEER_CONSUMERS", "8"));
const BATCH_SIZE = Number(env("PEER_BATCH_SIZE", "10"));
const STATEMENTS = env("PEER_STATEMENTS", "batch");
const OWNER = "sqs-consumer";
if (!["batch", "each"].includes(STATEMENTS)) {
  process.stderr.write("peer: PEER_STATEMENTS must be batch or each\n");
  process.exit(2);
}

const INSERT_MANY = `
INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,
                           sqs_message_id, owner, sent_at, completed_at)
SELECT request_id, request_type, payload::jsonb, payload_sha256, 'COMPLETED', sqs_message_id,
       $6, sent_at, statement_timestamp()
  FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $7::timestamptz[])
    AS t(request_id, request_type, payload, payload_sha256, sqs_message_id, sent_at)
 ORDER BY request_id
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id`;

const UPSERT_MANY = `
INSERT INTO entities AS e (entity_id, version, deleted, data, request_id, updated_at)
SELECT entity_id, version, false, data::jsonb, request_id, now()
  FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[])
    AS t(entity_id, version, data, request_id)
 ORDER BY entity_id
ON CONFLICT (entity_id) DO UPDATE
   SET version = EXCLUDED.version, deleted = EXCLUDED.deleted, data = EXCLUDED.data,
       request_id = EXCLUDED.request_id, updated_at = now()
 WHERE e.version < EXCLUDED.version`;

const INSERT_ONE = `
INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,
                           sqs_message_id, owner, sent_at, completed_at)
VALUES ($1, $2, $3::jsonb, $4, 'COMPLETED', $5, $6, $7, statement_timestamp())
ON CONFLICT (request_id) DO NOTHING
RETURNING request_id`;

const UPSERT_ONE = `
INSERT INTO entities AS e (entity_id, version, deleted, data, request_id, updated_at)
VALUES ($1, $2, false, $3::jsonb, $4, now())
ON CONFLICT (entity_id) DO UPDATE
   SET version = EXCLUDED.version, deleted = EXCLUDED.deleted, data = EXCLUDED.data,
       request_id = EXCLUDED.request_id, updated_at = now()
 WHERE e.version < EXCLUDED.version`;

// Key-sorted compact JSON (the daemon's canonical_json): equal payloads hash equal.
function canonical(value) {
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  if (value !== null && typeof value === "object") {
    return `{${Object.keys(value).sort()
      .map((k) => `${JSON.stringify(k)}:${canonical(value[k])}`).join(",")}}`;
  }
  return JSON.stringify(value);
}

// The envelope and payload checks of the reference handler, by hand.
function parse(message) {
  const doc = JSON.parse(message.Body);
  const p = doc.payload;
  if (typeof doc.request_id !== "string" || !doc.request_id
      || doc.type !== "entity.upsert" || p === null || typeof p !== "object"
      || typeof p.entity_id !== "string" || !Number.isSafeInteger(p.version)
      || p.data === null || typeof p.data !== "object" || Array.isArray(p.data)) {
    throw new Error(`not an entity.upsert: ${message.MessageId}`);
  }
  const payload = canonical(p);
  return {
    requestId: doc.request_id, type: doc.type, payload,
    sha256: createHash("sha256").update(payload).digest("hex"),
    messageId: message.MessageId, sentAt: doc.sent_at ?? null,
    entityId: p.entity_id, version: p.version, data: JSON.stringify(p.data),
  };
}

async function writeBatch(client, rows) {
  const inserted = new Set((await client.query(INSERT_MANY, [
    rows.map((r) => r.requestId), rows.map((r) => r.type), rows.map((r) => r.payload),
    rows.map((r) => r.sha256), rows.map((r) => r.messageId), OWNER,
    rows.map((r) => r.sentAt),
  ])).rows.map((r) => r.request_id));
  // One row per entity (the highest version): ON CONFLICT cannot touch a row twice.
  const best = new Map();
  for (const r of rows) {
    if (!inserted.has(r.requestId)) continue;
    const seen = best.get(r.entityId);
    if (!seen || r.version > seen.version) best.set(r.entityId, r);
  }
  const ents = [...best.values()];
  if (ents.length) {
    await client.query(UPSERT_MANY, [
      ents.map((r) => r.entityId), ents.map((r) => String(r.version)),
      ents.map((r) => r.data), ents.map((r) => r.requestId),
    ]);
  }
  return inserted.size;
}

async function writeEach(client, rows) {
  let inserted = 0;
  for (const r of rows) {
    const ins = await client.query(INSERT_ONE, [r.requestId, r.type, r.payload, r.sha256,
      r.messageId, OWNER, r.sentAt]);
    if (ins.rowCount) {
      inserted += 1;
      await client.query(UPSERT_ONE, [r.entityId, String(r.version), r.data, r.requestId]);
    }
  }
  return inserted;
}

const stats = { consumers: CONSUMERS, batch_size: BATCH_SIZE, statements: STATEMENTS,
  batches: 0, messages: 0, inserted: 0, errors: 0, error_samples: [] };
const pool = new pg.Pool({ connectionString: DATABASE_URL, max: CONSUMERS });
const sqs = new SQSClient({ endpoint: ENDPOINT, region: process.env.AWS_DEFAULT_REGION });
const write = STATEMENTS === "batch" ? writeBatch : writeEach;

async function handleMessageBatch(messages) {
  const rows = messages.map(parse);
  const client = await pool.connect();
  try {
    await client.query("BEGIN");
    const inserted = await write(client, rows); // not `+= await`: batches interleave
    await client.query("COMMIT");
    stats.inserted += inserted;
  } catch (err) {
    await client.query("ROLLBACK").catch(() => {});
    throw err;
  } finally {
    client.release();
  }
  stats.batches += 1;
  stats.messages += messages.length;
  return messages; // all acknowledged: sqs-consumer deletes them (DeleteMessageBatch)
}

let stopping = false;
const noteError = (err) => {
  if (stopping) return; // the long polls stop() aborts
  stats.errors += 1;
  if (stats.error_samples.length < 5) stats.error_samples.push(String(err?.message ?? err));
};

const consumers = Array.from({ length: CONSUMERS }, () => {
  const c = Consumer.create({
    queueUrl: QUEUE_URL, sqs, useQueueUrlAsEndpoint: false, batchSize: BATCH_SIZE,
    waitTimeSeconds: 20, handleMessageBatch, strictReturn: true,
  });
  c.on("error", noteError);
  c.on("processing_error", noteError);
  c.on("timeout_error", noteError);
  return c;
});

async function stop() {
  if (stopping) return;
  stopping = true;
  for (const c of consumers) c.stop({ abort: true });
  await pool.end();
  process.stdout.write(`${JSON.stringify(stats)}\n`);
  process.exit(0);
}
process.on("SIGTERM", stop);
process.on("SIGINT", stop);

for (const c of consumers) c.start();
process.stderr.write(`peer: ${CONSUMERS} consumers started (batch ${BATCH_SIZE}, `
  + `statements ${STATEMENTS})\n`);
