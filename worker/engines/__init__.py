"""Engine adapters behind one protocol mirroring the tick ABI (DESIGN.md "Engines")."""
