"""Replay of dumped calls on the CPU in float64, from one side's own inputs: that side's *local*
error, the error its kernel added to what it was handed (docs/compare.md, section Replay).

The one part of a comparison that imports torch; `compare` imports it only when both dumps hold
full tensors. Nothing from a dump is unpickled, and API names resolve only to torch's own
overridable callables (`apis.py`): a dump from elsewhere cannot run code.
"""

from pi0align.replay.local_error import RecordedCall, Replayed, replay

__all__ = ["RecordedCall", "Replayed", "replay"]
