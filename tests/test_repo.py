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


def test_requirements_pin_a_torch_torchvision_pair_whose_compiled_ops_work():
    reqs = (REPO / "requirements.txt").read_text()
    assert re.search(r"^torch==\S+$", reqs, re.M) and re.search(r"^torchvision==\S+$", reqs, re.M)
    import torch
    from torchvision.ops import nms

    # A CPU-only torch with a CUDA torchvision fails exactly here ("operator torchvision::nms does not exist").
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]])
    assert nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5).tolist() == [0, 2]
