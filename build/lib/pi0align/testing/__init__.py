"""Helpers that the tests and the benchmarks share: other devices' numerics emulated on the CPU
(`devices.py`), small models (`models.py`) and dumped runs of them (`scenarios.py`), dump files
written directly from a numpy toy model (`dumpfactory.py`), and a hand-built model with readers of
a dump's tables (`dump_helpers.py`)."""
