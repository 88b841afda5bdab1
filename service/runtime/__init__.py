"""The worker and what it runs: the receive loop (worker), one batch's claim -> apply ->
complete (batch, executor, bisection on a failing handler, resolving S3 pointers), the
visibility heartbeat, the result publisher, maintenance, database health, and the chaos tests'
crash point. It speaks service.errors only (no driver import: an import-linter contract) and may
import service.handlers, service.adapters, service.observe, service.core and the foundation.
"""
