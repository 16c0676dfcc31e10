"""Helpers that the tests and the benchmarks share: other devices' numerics emulated on the CPU
(`devices.py`), small models (`models.py`) and dumped runs of them (`scenarios.py`)."""
