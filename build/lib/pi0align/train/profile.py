"""`--profile START:END`: steps START to END − 1 recorded with torch.profiler (torch_npu's on the
NPU) as a TensorBoard trace in `<run>/profile/`, and a one-screen table of the most expensive ops."""

from __future__ import annotations

from pathlib import Path

import torch

from pi0align.device import Device

TOP_OPS = 15


class StepProfiler:
    """Profiles the steps of `window` (a range): `before(step)` and `after(step)` around each step;
    the trace is written when the window's last step ends."""

    def __init__(self, window: range, out: Path, device: Device):
        self.window, self.out, self.device = window, out, device
        self.profiler = None

    def before(self, step: int) -> None:
        if self.window and step == self.window.start:
            profiler, activities = _profiler_module(self.device)
            # every step of the window active, once: each a ProfilerStep#k range of one trace
            window = profiler.schedule(wait=0, warmup=0, active=len(self.window), repeat=1)
            self.profiler = profiler.profile(activities=activities, schedule=window,
                                             on_trace_ready=profiler.tensorboard_trace_handler(str(self.out)))
            self.profiler.__enter__()

    def after(self, step: int) -> str | None:
        """After a step: the table of the most expensive ops once the window ends, else None."""
        if self.profiler is None:
            return None
        self.profiler.step()
        if step != self.window[-1]:
            return None
        self.profiler.__exit__(None, None, None)
        table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)
        self.profiler = None
        return table


def _profiler_module(device: Device):
    """torch.profiler, or torch_npu's on the NPU; with the activities the device has."""
    if device.type == "npu":
        import torch_npu

        return torch_npu.profiler, [torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler, activities
