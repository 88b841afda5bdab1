"""The outside world behind the seams: SQS (sqs), PostgreSQL (store, its named SQL in sql/,
the driver-error translation pgerrors, the schema check and migrations runner migrate, the
completion loops the store and the fakes share, prune's deletes), S3 payloads (payloads), the
result sinks (sinks), the replica's name (identity) and the client user agent. The only layer
that imports the drivers (asyncpg, aiobotocore, botocore); it may import service.observe,
service.core and the foundation, never service.runtime, service.ops or service.testing.
"""
