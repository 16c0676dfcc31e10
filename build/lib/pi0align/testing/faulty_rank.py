"""A fault on one rank of a run of several processes, for the tests:

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m pi0align.testing.faulty_rank RANK FUNCTION FACTOR run ARGS...

runs `pi0align run ARGS...` as each rank, every call of FUNCTION (a name of scenarios.FUNCTIONS)
on rank RANK returning its result × FACTOR (devices.EveryCall), pushed before the dumper's mode.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    rank, function, factor, command = int(argv[0]), argv[1], float(argv[2]), argv[3:]
    if int(os.environ.get("RANK", "0")) == rank:
        from pi0align.testing.devices import EveryCall
        from pi0align.testing.scenarios import FUNCTIONS

        EveryCall(FUNCTIONS[function], factor).__enter__()  # for the process's life
    from pi0align.cli.main import main as pi0align

    return pi0align(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
