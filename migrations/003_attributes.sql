-- Real queues (issue 11): what a message carried besides its body, kept with its request.
-- Additive: nullable columns, no rewrite of existing rows (ADD COLUMN without a default is a
-- catalog change only), so it applies under a running daemon of the previous version.

-- The SQS message attributes and those of the SNS envelope it came in, as SQS returns them
-- ({"name": {"DataType": "String", "StringValue": "…"}}); NULL when there were none.
ALTER TABLE modifications ADD COLUMN message_attributes jsonb;

-- Where an S3-offloaded payload was read from (s3://bucket/key, from the extended clients'
-- pointer); NULL for an inline body. Once the object is deleted after the request's commit
-- and ack (INGEST_S3_DELETE_AFTER_ACK), a redelivered pointer finds its request here and
-- is acked as a duplicate instead of dead-lettered as payload_object_missing.
ALTER TABLE modifications ADD COLUMN payload_pointer text;
CREATE INDEX IF NOT EXISTS modifications_payload_pointer_idx ON modifications (payload_pointer)
    WHERE payload_pointer IS NOT NULL;
