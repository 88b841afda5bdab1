"""The domain, pure: what a message is (parse, attributes, S3 pointers, limits, labels), what
to do with a batch (plan, retry policy, retention policy, claims registry), the seams' protocols
the runtime drives (seams) and the handler registry. No I/O: it may import service.settings,
service.errors and the standard library, never a driver (asyncpg, aiobotocore, botocore,
aiohttp — an import-linter contract) nor any other subpackage of service. asyncio appears only
as the stop event and the in-memory byte budget's condition, never to reach the network.
"""
