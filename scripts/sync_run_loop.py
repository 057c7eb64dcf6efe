"""Copy `Executor._execute` into ARCHITECTURE.md's run loop on one screen (its test,
tests/unit/test_architecture_doc.py, fails while the copy differs).

    python scripts/sync_run_loop.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.unit.test_architecture_doc import MARK, source_run_loop  # noqa: E402


def main() -> None:
    path = ROOT / "ARCHITECTURE.md"
    before, after = path.read_text().split(MARK, 1)
    head, rest = after.split("```python\n", 1)
    _, tail = rest.split("```", 1)
    path.write_text(before + MARK + head + "```python\n" + source_run_loop() + "```" + tail)


if __name__ == "__main__":
    main()
