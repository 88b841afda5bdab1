"""What the daemon tells its operator: Prometheus metrics and their HTTP endpoint (metrics),
structured logs (logs), OpenTelemetry spans (tracing). It may import service.core and the
foundation at the top (settings, errors, secrets); the adapters, the runtime and the commands
import it, never the other way round.
"""
