"""The suite's slowest tests, kept in tests/durations.json, and each run compared with them.

Per test: wall seconds (setup + call + teardown, so a module fixture counts for the test that set it
up) and CPU seconds of the test process plus the children it waited for (getrusage): CPU seconds
grow far less than wall time on a loaded machine, so they are what a regression is judged by first.
`pytest --record-durations` rewrites the file from the run (do it from a full `make test`); every
run prints a warning block for each recorded test that became FACTOR times slower and more than the
floor in seconds (load on a shared machine moves both). It warns, it does not fail: the wall time of
one test on a 2-core machine shared by others is not a number to fail a build on.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

RECORD = Path(__file__).with_name("durations.json")
KEEP = 40  # the slowest tests kept in the record
FACTOR = 2.0  # slower than this many times its recorded figure ...
WALL_FLOOR_S = 60.0  # ... and by more than this many seconds of wall time
CPU_FLOOR_S = 30.0  # ... or of CPU time


def cpu_seconds() -> float:
    """User + system CPU of this process and of its waited-for children (and theirs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def plain_nodeid(nodeid: str) -> str:
    """The test's id without the "@group" that `--dist loadgroup` appends (as xdist splits it)."""
    return nodeid.rsplit("@", 1)[0] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


class Timings:
    """Collects each test's wall and CPU seconds from its reports (in the controller under xdist)."""

    def __init__(self):
        self.tests: dict[str, dict[str, float]] = {}
        self.started = time.monotonic()

    def add(self, report) -> None:
        entry = self.tests.setdefault(plain_nodeid(report.nodeid), {"wall_s": 0.0, "cpu_s": 0.0})
        entry["wall_s"] += report.duration
        entry["cpu_s"] += dict(report.user_properties).get("cpu_s", 0.0)

    def slowest(self, n: int = KEEP) -> dict[str, dict[str, float]]:
        ranked = sorted(self.tests.items(), key=lambda kv: kv[1]["wall_s"], reverse=True)[:n]
        return {k: {f: round(v, 1) for f, v in e.items()} for k, e in ranked}

    def totals(self) -> dict[str, float]:
        return {
            "tests": len(self.tests),
            "wall_s": round(time.monotonic() - self.started, 1),
            "test_wall_s": round(sum(e["wall_s"] for e in self.tests.values()), 1),
            "cpu_s": round(sum(e["cpu_s"] for e in self.tests.values()), 1),
        }


def unit_walls(timings: Timings, unit_of) -> dict[str, float]:
    """Each work unit's (unit_of: nodeid -> unit) wall seconds, all of its tests, heaviest first."""
    units: dict[str, float] = {}
    for nodeid, entry in timings.tests.items():
        units[unit_of(nodeid)] = units.get(unit_of(nodeid), 0.0) + entry["wall_s"]
    return {u: round(w, 1) for u, w in sorted(units.items(), key=lambda kv: kv[1], reverse=True)}


def record(timings: Timings, workers: int, unit_of=None) -> dict:
    data = {
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "how": "make test PYTEST_ARGS=--record-durations (pytest -n 2, tests/conftest.py's work units); a full run",
        "workers": workers,
        "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
        "totals": timings.totals(),
        "slowest": timings.slowest(),
    }
    if unit_of is not None:  # what the scheduler orders by (tests/conftest.py): every unit, not the slowest tests
        data["units"] = unit_walls(timings, unit_of)
    RECORD.write_text(json.dumps(data, indent=1) + "\n")
    return data


def slower_than_recorded(timings: Timings, recorded: dict) -> list[str]:
    """One line per recorded test that ran FACTOR times slower and by more than the floor."""
    lines = []
    for nodeid, old in recorded.get("slowest", {}).items():
        new = timings.tests.get(nodeid)
        if new is None:
            continue
        for field, floor in (("cpu_s", CPU_FLOOR_S), ("wall_s", WALL_FLOOR_S)):
            if field not in old:  # an entry measured by wall clock only
                continue
            if new[field] > FACTOR * old[field] and new[field] - old[field] > floor:
                lines.append(
                    f"{nodeid}: {field[:-2]} {new[field]:.0f} s, recorded {old[field]:.0f} s "
                    f"({new[field] / max(old[field], 1e-9):.1f}x)"
                )
                break
    return lines


def new_slow_tests(timings: Timings, recorded: dict) -> list[str]:
    """Tests absent from the record that are slower than its slowest but one: new budget eaters."""
    slowest = recorded.get("slowest", {})
    if len(slowest) < 2:
        return []
    bar = sorted(e["wall_s"] for e in slowest.values())[-2]
    return [
        f"{nodeid}: wall {e['wall_s']:.0f} s, CPU {e['cpu_s']:.0f} s (not in tests/durations.json)"
        for nodeid, e in timings.slowest(len(timings.tests)).items()
        if nodeid not in slowest and e["wall_s"] > max(bar, WALL_FLOOR_S)
    ]


def summary(timings: Timings, write) -> None:
    """Compare the run with tests/durations.json; `write(line)` prints to the terminal."""
    if not RECORD.exists():
        write(f"no {RECORD.name} to compare with: a full `make test PYTEST_ARGS=--record-durations` writes it")
        return
    recorded = json.loads(RECORD.read_text())
    now, then = timings.totals(), recorded.get("totals", {})
    write(
        f"suite timing: {now['tests']} tests, wall {now['wall_s']:.0f} s, CPU {now['cpu_s']:.0f} s; "
        f"{RECORD.name} ({recorded.get('recorded')}, load {recorded.get('load_average_at_end')}): "
        f"{then.get('tests')} tests, wall {then.get('wall_s', 0):.0f} s, CPU {then.get('cpu_s', 0):.0f} s; "
        f"load now {[round(x, 1) for x in os.getloadavg()]}"
    )
    slower, new = slower_than_recorded(timings, recorded), new_slow_tests(timings, recorded)
    if slower or new:
        bar = "!" * 100
        write(bar)
        write(f"WARNING: tests slower than tests/durations.json ({FACTOR:g}x and +{CPU_FLOOR_S:.0f} s CPU")
        write(f"or +{WALL_FLOOR_S:.0f} s wall), or new tests among the slowest: the 25-minute CI budget is at stake")
        for line in slower + new:
            write("  " + line)
        write("(a loaded machine inflates wall time: compare the CPU figure first; docs/testing.md)")
        write(bar)


def recorded_walls() -> dict[str, float]:
    """nodeid -> recorded wall seconds (empty without a record)."""
    try:
        return {k: e["wall_s"] for k, e in json.loads(RECORD.read_text()).get("slowest", {}).items()}
    except (OSError, ValueError, KeyError):
        return {}


def recorded_units() -> dict[str, float]:
    """work unit -> recorded wall seconds of all its tests (empty without a record, or an older one)."""
    try:
        return {k: float(w) for k, w in json.loads(RECORD.read_text()).get("units", {}).items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
