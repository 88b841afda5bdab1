"""sqs-ingest: SQS → PostgreSQL, exactly once in effect.

The tree by role, top to bottom (each layer imports only from the ones below it; checked by
import-linter, pyproject.toml): ``cli`` the commands, ``app`` the wiring of ``run``, ``ops/``
the operator's other commands, ``testing/`` the test kit, ``reconcile/`` the Spark job,
``runtime/`` the worker and what it runs, ``adapters/`` SQS, PostgreSQL and S3, ``handlers/``
the handler API, ``observe/`` metrics, logs and traces, ``core/`` the pure domain, then
``settings`` and what it is built on (``errors``, ``secrets``, ``s3access``). Public for
handler authors: ``service.handlers`` and ``service.testing``; everything else is internal.
"""

__version__ = "0.1.0"
