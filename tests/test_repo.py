"""The repository keeps its promises about itself: a torch pair that works. (common/ free of import
cycles: .ci/lint.py, common-import-cycle; that CI runs the README's test command:
tests/test_readme_commands.py.)"""

import re

from tests.paths import REPO


def test_requirements_pin_a_torch_torchvision_pair_whose_compiled_ops_work():
    reqs = (REPO / "requirements.txt").read_text()
    assert re.search(r"^torch==\S+$", reqs, re.M) and re.search(r"^torchvision==\S+$", reqs, re.M)
    import torch
    from torchvision.ops import nms

    # A CPU-only torch with a CUDA torchvision fails exactly
    # here ("operator torchvision::nms does not exist").
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]])
    assert nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5).tolist() == [0, 2]
