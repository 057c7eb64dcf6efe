"""Run README.md's install lines as written, from the folder `git clone` leaves a user in, in
a new venv, then the demo with what they installed.

The one line not run as written is the CPU torch from PyTorch's own index, which machines
without that index cannot reach: it becomes `pip install torch==<the pin of constraints.txt>`
(the CPU wheel on the development machine), and the script says so. Every other line of the
README's first sh block under "## Install" runs with the venv's pip, in the repository root.

    python scripts/readme_install.py [--venv build/readme-venv]
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install_lines(readme: str) -> list[str]:
    """The commands of the first ```sh block after the '## Install' heading, comments cut."""
    section = readme.split("\n## Install", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    if block is None:
        raise SystemExit("README.md: no ```sh block under '## Install'")
    lines = [line.split(" #", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def pinned_torch() -> str:
    pin = next(line for line in (ROOT / "constraints.txt").read_text().splitlines()
               if line.startswith("torch=="))
    return pin.split("#", 1)[0].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / "build" / "readme-venv")
    venv: Path = parser.parse_args().venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    for line in install_lines((ROOT / "README.md").read_text()):
        words = shlex.split(line)
        if words[:2] != ["pip", "install"]:
            raise SystemExit(f"README.md's install block: not a pip install line: {line!r}")
        if "download.pytorch.org" in line:
            words = ["pip", "install", pinned_torch()]
            print(f"readme-install: {line!r} -> {shlex.join(words)!r} (no PyTorch index here)")
        print(f"readme-install: $ {shlex.join(words)}", flush=True)
        subprocess.run([*pip, *words[1:]], cwd=ROOT, check=True)
    demo = [str(venv / "bin" / "asyncgraph"), "demo", "--executions", "64", "--concurrency", "8"]
    print(f"readme-install: $ {shlex.join(demo)}", flush=True)
    return subprocess.run(demo, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
