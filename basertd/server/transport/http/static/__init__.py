"""The operator's page at ``/`` (``basertd.server.transport.http.opsview``): package data, no code."""
