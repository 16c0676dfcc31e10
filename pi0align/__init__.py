"""pi0align: precision alignment and diffing for LeRobot PI0 training across devices."""

from pi0align.version import __version__

__all__ = ["__version__"]


def __getattr__(name: str):
    # Lazy: `import pi0align.compare` must not import torch, which `Dumper` needs.
    if name == "Dumper":
        from pi0align.dump import Dumper

        return Dumper
    if name == "Monitor":  # every module at every step (pi0align/dump/monitoring/monitor.py)
        from pi0align.dump.monitoring.monitor import Monitor

        return Monitor
    if name == "clip_gradients":  # clip_grad_norm_, its norms handed to a monitor (pi0align/clipping.py)
        from pi0align.clipping import clip_gradients

        return clip_gradients
    if name == "load_monitor":  # runs' monitors as one DataFrame (pi0align/runs/monitor.py)
        from pi0align.runs.monitor import load_monitor

        return load_monitor
    if name == "audit":  # one run judged alone (pi0align/auditing)
        from pi0align.auditing import audit

        return audit
    if name == "bisect":  # from "the curves part" to the step and the call (pi0align/bisecting)
        from pi0align.bisecting import bisect

        return bisect
    raise AttributeError(f"module 'pi0align' has no attribute {name!r}")
