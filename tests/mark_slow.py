"""Rewrite tests/slow_tests.txt from a full run's JUnit XML: every test that took
THRESHOLD_S or more is marked slow (tests/conftest.py reads the file), so
`pytest -m "not slow"` stays a quick edit loop.

    python -m pytest -p no:cacheprovider --junitxml=/tmp/junit.xml   # the whole suite
    python tests/mark_slow.py /tmp/junit.xml

Not collected by pytest. Tests marked `@pytest.mark.slow` in their module stay slow
whatever the file says.
"""

import os
import sys
import xml.etree.ElementTree as ET

THRESHOLD_S = 1.5               # seconds of one test, measured under `-n 2` on 2 CPU cores
# (2.5 until the post-training round: its tests took the edit loop to 6 min 37 s)
SLOW_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


def node_id(case: ET.Element) -> str:
    """tests.test_x + test_y[p] -> tests/test_x.py::test_y[p] (classes are not used)."""
    return case.get("classname").replace(".", "/") + ".py::" + case.get("name")


def main(junit: str) -> None:
    slow = sorted(node_id(c) for c in ET.parse(junit).iter("testcase")
                  if float(c.get("time")) >= THRESHOLD_S and c.find("skipped") is None)
    with open(SLOW_TESTS, "w") as f:
        f.write(f"# Tests of {THRESHOLD_S} s or more in a full run (tests/mark_slow.py "
                "writes this file)\n")
        f.write("".join(f"{n}\n" for n in slow))
    print(f"{len(slow)} tests of {THRESHOLD_S} s or more -> {SLOW_TESTS}")


if __name__ == "__main__":
    main(sys.argv[1])
