"""The README's two commands are scripts/run.sh and scripts/test.sh, and .ci/run runs the
test command verbatim: an edit to one that misses the others shows here, not on the next
fresh machine."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CI_MARK = "# --- the README's test command, verbatim ---"


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def readme_command(section: str) -> str:
    """The first bash block under the README's `## {section}` heading."""
    match = re.search(rf"^## {section}\n\n```bash\n(.*?)\n```", read("README.md"), re.M | re.S)
    assert match, f"README.md has no bash block right under '## {section}'"
    return match.group(1)


@pytest.mark.parametrize("section, command", [("Run it", "./scripts/run.sh"),
                                              ("Test it", "./scripts/test.sh")])
def test_the_readme_commands_are_the_scripts(section, command):
    assert readme_command(section) == command
    assert os.access(os.path.join(ROOT, command), os.X_OK), f"{command} is not executable"


def test_ci_runs_the_readme_test_command_verbatim():
    if not os.path.exists(os.path.join(ROOT, ".ci", "run")):
        pytest.skip("no .ci/run here (an sdist ships without it)")
    lines = read(".ci/run").splitlines()
    assert CI_MARK in lines
    after = [line for line in lines[lines.index(CI_MARK) + 1:] if line.strip()]
    assert after == [readme_command("Test it")]
    # Everything .ci/run installs, it installs through that command.
    before = "\n".join(line for line in lines[:lines.index(CI_MARK)]
                       if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(pip|apt-get|apt)\b", before), before


@pytest.mark.parametrize("script", ["scripts/common.sh", "scripts/run.sh", "scripts/test.sh",
                                    ".ci/run"])
def test_the_scripts_parse(script):
    if not os.path.exists(os.path.join(ROOT, script)):
        pytest.skip(f"no {script} here (an sdist ships without .ci)")
    result = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
