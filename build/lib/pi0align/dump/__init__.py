"""Capture of API and module calls, forward and backward, with statistics computed on the
device, into one HDF5 file per rank (docs/dump-format.md)."""

__all__ = ["Dumper"]


def __getattr__(name: str):
    # Lazy: the writer process imports pi0align.dump's file modules, never torch, which `Dumper` needs.
    if name == "Dumper":
        from pi0align.dump.dumper import Dumper

        return Dumper
    raise AttributeError(f"module 'pi0align.dump' has no attribute {name!r}")
