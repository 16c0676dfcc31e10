"""Capture of API and module calls, forward and backward, with statistics computed on the
device, into one HDF5 file per rank (docs/dump-format.md)."""

from pi0align.dump.dumper import Dumper

__all__ = ["Dumper"]
