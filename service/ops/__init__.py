"""The operator's commands besides ``run``: diagnose, produce, prune (prune_command), redrive,
dlq (list, show, replay dead letters), schema. Each is called from service.cli; they may import
service.adapters, service.observe, service.core and the foundation, not the runtime's loops and
not service.testing. Internal: their interface is the ``sqs-ingest`` command line.
"""
