"""A stand-in benchmark child for ``test_bench_reports``: ``ok`` reports progress then a
result, ``fail`` dies with a message on stderr, ``hang`` never answers, ``killed`` is
SIGKILLed (as the kernel's out-of-memory killer would)."""

import json
import os
import signal
import sys
import time

from benchmarks._report import progress

mode = sys.argv[1]
if mode == "ok":
    progress("row 1 of 2")
    print("some other output", flush=True)
    progress("row 2 of 2")
    print("RESULT " + json.dumps({"rows": 2}), flush=True)
elif mode == "fail":
    print("the child's own reason", file=sys.stderr, flush=True)
    raise SystemExit(3)
elif mode == "killed":
    progress("row 1 of 2")
    os.kill(os.getpid(), signal.SIGKILL)
else:
    time.sleep(60)
