"""Every solver benchmark in one go: the IOPDDL instances, then the stage-DP grid.

python -m benchmarks.solvers           # full runs (~16 min + ~50 min), BENCHMARKS.md updated
python -m benchmarks.solvers --quick   # smoke run: short limits, small grid, nothing written
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import iopddl, stage_dp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short smoke run; writes nothing")
    args = parser.parse_args(argv)
    iopddl.main(["--time-scale", "0.1", "--no-write"] if args.quick else [])
    return stage_dp.main(["--quick", "--no-write"] if args.quick else [])


if __name__ == "__main__":
    sys.exit(main())
