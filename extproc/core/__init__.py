"""The scheduling core: pure, no I/O, time passed in; it imports nothing from the adapters."""
