"""`python -m service`: the same entry point as the `sqs-ingest` console script."""

from service.cli import main

raise SystemExit(main())
