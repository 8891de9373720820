"""The Python client library for the basertd Unix socket (sync and asyncio)."""
