"""The tick-ABI header, its cffi binding, the C reference engine and the ring atomics."""
