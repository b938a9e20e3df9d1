"""The durations record's comparison (tests/suite_timing.py): a test that doubles is named, load noise is not."""

from types import SimpleNamespace

import suite_timing


def timings(**tests) -> suite_timing.Timings:
    t = suite_timing.Timings()
    for name, (wall, cpu) in tests.items():
        t.add(SimpleNamespace(nodeid=f"tests/t.py::{name}@grp", duration=wall, user_properties=[("cpu_s", cpu)]))
    return t


RECORDED = {
    "slowest": {
        "tests/t.py::doubled": {"wall_s": 100.0, "cpu_s": 40.0},
        "tests/t.py::loaded": {"wall_s": 100.0, "cpu_s": 40.0},
        "tests/t.py::small": {"wall_s": 10.0, "cpu_s": 5.0},
        "tests/t.py::steady": {"wall_s": 300.0, "cpu_s": 100.0},
    }
}


def test_a_test_that_doubles_its_cpu_is_named_and_load_alone_is_not():
    now = timings(doubled=(150.0, 90.0), loaded=(180.0, 45.0), small=(40.0, 20.0), steady=(310.0, 100.0))
    lines = suite_timing.slower_than_recorded(now, RECORDED)
    # doubled: CPU 40 -> 90 s (2.25x, +50 s); loaded: wall 1.8x, CPU flat; small: 4x but under the floors
    assert lines == ["tests/t.py::doubled: cpu 90 s, recorded 40 s (2.2x)"]
    lines = suite_timing.slower_than_recorded(timings(loaded=(400.0, 45.0)), RECORDED)
    assert lines == ["tests/t.py::loaded: wall 400 s, recorded 100 s (4.0x)"]  # a wait (no CPU) that quadrupled


def test_a_new_test_slower_than_the_recorded_ones_is_named():
    now = timings(brand_new=(200.0, 60.0), other_new=(20.0, 5.0))
    assert suite_timing.new_slow_tests(now, RECORDED) == [
        "tests/t.py::brand_new: wall 200 s, CPU 60 s (not in tests/durations.json)"
    ]


def test_the_group_suffix_of_loadgroup_is_not_part_of_the_id():
    assert suite_timing.plain_nodeid("tests/a.py::t@tiny_pipeline") == "tests/a.py::t"
    assert suite_timing.plain_nodeid("tests/a.py::t[x@y]") == "tests/a.py::t[x@y]"  # a parameter's @ stays
    assert suite_timing.plain_nodeid("tests/a.py::t[x@y]@g") == "tests/a.py::t[x@y]"


def test_the_record_sums_every_test_of_a_work_unit_heaviest_first():
    t = suite_timing.Timings()
    for nodeid, wall in (
        ("tests/a.py::x", 10.0),
        ("tests/a.py::y", 5.5),
        ("tests/b.py::z", 30.0),
        ("tests/c.py::w", 1),
    ):
        t.add(SimpleNamespace(nodeid=nodeid, duration=wall, user_properties=[("cpu_s", 1.0)]))
    units = suite_timing.unit_walls(t, lambda nodeid: "ab" if nodeid.startswith("tests/b") else nodeid.split("::")[0])
    assert units == {"ab": 30.0, "tests/a.py": 15.5, "tests/c.py": 1.0}
    assert list(units) == ["ab", "tests/a.py", "tests/c.py"]
