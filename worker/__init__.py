"""The engine-worker process: Link W server side and engine adapters (DESIGN.md "Engines")."""
