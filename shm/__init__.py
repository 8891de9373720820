"""Anonymous shared-memory segments (memfd) and BRTRING1 rings (DESIGN.md "Rings")."""
