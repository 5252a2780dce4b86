"""The repository keeps its promises about itself: CI runs the README's command."""

import re

from tests.helpers import REPO


def readme_test_command():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Tests"):]
    return re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip()


def test_ci_runs_the_readme_test_command():
    command = readme_test_command()
    assert "pytest" in command
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines
    # The quick start shows the same command.
    assert (REPO / "README.md").read_text().count(command) >= 2


def test_requirements_pin_a_working_torch_torchvision_pair():
    reqs = (REPO / "requirements.txt").read_text()
    assert "torch==2.14.1" in reqs and "torchvision==0.29.1" in reqs
    import torch
    import torchvision

    assert torchvision.ops.nms is not None  # torchvision's compiled ops import with this torch
    assert torch.__version__.startswith("2.14.1") and torchvision.__version__.startswith("0.29.1")
