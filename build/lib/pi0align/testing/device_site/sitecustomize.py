"""Loaded by every Python process started with this folder on PYTHONPATH (tests only): the emulated
device PI0ALIGN_EMULATED_DEVICE describes (JSON: testing.devices.EmulatedDevice's arguments),
entered for the process's life."""

import json
import os

if os.environ.get("PI0ALIGN_EMULATED_DEVICE"):
    from pi0align.testing.devices import EmulatedDevice

    EmulatedDevice(**json.loads(os.environ["PI0ALIGN_EMULATED_DEVICE"])).__enter__()
