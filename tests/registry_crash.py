"""Test-only: run the promote stage and SIGKILL it at one point inside its registry write.

    python tests/registry_crash.py POINT [promote stage arguments...]

POINT is where the process dies (it kills itself with SIGKILL, so nothing after it runs, no finally, no
atexit), in the order promote reaches them:

    mid_append    halfway through writing the log entry's line (a torn last line, no newline)
    after_append  right after the log entry is on disk, before the champion directory is swapped
    before_alias  after the swap, before the registry's alias is pointed at the new champion

(A death while the champion is assembled aside, before anything is logged, is the build failure
tests/test_registry.py and tests/test_promotion.py already raise in-process.) The points are the module-level
names fineflow.registry.champion calls (append_log, set_alias), replaced here, in this process only.
Production code has no fault switch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def after(real):
    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        die()
        return result

    return wrapper


def torn_append(registry_dir: Path, entry: dict) -> None:
    """Write the first half of the entry's line, as a writer that died mid-write leaves it."""
    line = json.dumps({"seq": 0, **entry}, sort_keys=True)
    with (Path(registry_dir) / "promotions.jsonl").open("a", encoding="utf-8") as fh:
        fh.write(line[: len(line) // 2])
        fh.flush()
        os.fsync(fh.fileno())
    die()


def install(point: str) -> None:
    from fineflow.registry import champion

    patches = {
        "mid_append": ("append_log", torn_append),
        "after_append": ("append_log", after(champion.append_log)),
        "before_alias": ("set_alias", die),
    }
    name, replacement = patches[point]
    setattr(champion, name, replacement)


if __name__ == "__main__":
    install(sys.argv[1])
    from fineflow.stages import promote

    raise SystemExit(promote.main(sys.argv[2:]))
