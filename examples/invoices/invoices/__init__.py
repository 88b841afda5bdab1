"""An example handler package for sqs-ingest: invoices (README "Testing your handlers")."""
