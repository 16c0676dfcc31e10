"""`python -m pi0align.testing.appender DUMP LAYERS STEPS PAUSE`: write a dump of the toy model
with LAYERS layers (about 20 records a layer) and append STEPS copies of its step, printing
`appended N` after each, through the format module the dumper's writer process uses: the other
side of the tests that kill a writer mid-append or read a dump while it is written. A pause of
PAUSE seconds after each append stands for the training steps between two dumped ones (0: nearly
all of its time is spent inside appends). `start` runs it from a test, `stop_inside_an_append`
stops it there."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from pathlib import Path

from pi0align.dump.writing import dump_file, journal
from pi0align.testing.dumpfactory import run_toy_model, step_tables, write_dump


def main(path: Path, layers: int, steps: int, pause: float) -> None:
    (step,) = run_toy_model(layers=layers)
    write_dump(path, [])
    tables = step_tables(step, "stats", 0, {}, None)
    for number in range(steps):
        dump_file.append(path, dataclasses.replace(tables, step=number), [], [(number, 1.0, 1.0, 1e-3)], None)
        print(f"appended {number}", flush=True)
        time.sleep(pause)


def start(path: Path, layers: int, steps: int, pause: float) -> subprocess.Popen:
    """The appender in a process of its own, once it has appended its first two steps (the lines
    it prints after are left in its stdout)."""
    writer = subprocess.Popen([sys.executable, "-m", __spec__.name, str(path), str(layers), str(steps), str(pause)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in writer.stdout:
        if line.strip() == "appended 1":
            break
    return writer


def stop_inside_an_append(writer: subprocess.Popen, path: Path) -> None:
    """SIGSTOP the appender writing `path` at a moment its journal shows it inside an append."""
    while True:
        while not journal.journal_path(path).exists():
            time.sleep(0.001)
        writer.send_signal(signal.SIGSTOP)
        time.sleep(0.05)  # stopped by now
        if journal.journal_path(path).exists():
            return
        writer.send_signal(signal.SIGCONT)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
