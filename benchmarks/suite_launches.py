"""The test suite's launches and seconds per file, a baseline run against a changed one, side by side.

    python benchmarks/suite_launches.py BASE.xml BASE.log AFTER.xml AFTER.log

Each pair is one pytest run of the same files: `--junitxml=X.xml` (seconds per test: setup, call and teardown)
and its terminal output saved to X.log, whose summary holds the launch count per file that tests/conftest.py
prints (tests/support/launch_count.py). Run the two side by side on the same machine, so that both see the same
load; the ratio is what compares, the seconds depend on the load. Prints a Markdown table.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s+(\d+) (\S+\.py)$")


def seconds_per_file(junit: Path) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.distributed.test_x[.TestClass]
        module = max(i for i, part in enumerate(parts) if part.startswith("test_"))
        path = "/".join(parts[: module + 1]) + ".py"
        out[path] += float(case.get("time", 0))
    return dict(out)


def launches_per_file(log: Path) -> dict[str, int]:
    lines = log.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("launches: "))
    out = {}
    for line in lines[start + 1 :]:
        match = LINE.match(line)
        if not match:
            break
        out[match.group(2)] = int(match.group(1))
    return out


def main(base_xml: str, base_log: str, after_xml: str, after_log: str) -> None:
    base_s, after_s = seconds_per_file(Path(base_xml)), seconds_per_file(Path(after_xml))
    base_n, after_n = launches_per_file(Path(base_log)), launches_per_file(Path(after_log))
    print("| file | launches before | after | seconds before | after | after / before |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for path in sorted(set(base_s) | set(after_s)):
        b, a = base_s.get(path, 0.0), after_s.get(path, 0.0)
        ratio = f"{a / b:.2f}" if b else "-"
        print(f"| {path} | {base_n.get(path, 0)} | {after_n.get(path, 0)} | {b:.0f} | {a:.0f} | {ratio} |")
    b, a = sum(base_s.values()), sum(after_s.values())
    print(f"| all | {sum(base_n.values())} | {sum(after_n.values())} | {b:.0f} | {a:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:5])
