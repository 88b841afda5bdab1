"""sqs-ingest: SQS → PostgreSQL, exactly once in effect."""

__version__ = "0.1.0"
