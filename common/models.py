"""Models: a small CNN for the embedded digits (and CPU runs), torchvision ResNets."""

from torch import nn


class SmallCNN(nn.Module):
    """Two conv and two linear layers, any input size;
    BatchNorm after each conv only with norm="batch"."""

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 32, norm: str = "none"
    ):
        super().__init__()
        norm_layer = nn.BatchNorm2d if norm == "batch" else lambda channels: nn.Identity()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            norm_layer(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            norm_layer(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )  # 8x8 digits and 32x32 CIFAR images alike end as 4x4
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 16, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def build_model(
    name: str, num_classes: int, in_channels: int = 3, image_size: int = 32, norm: str = "none"
) -> nn.Module:
    """`small_cnn`, `resnet18` or `resnet50`; ResNets get a CIFAR stem for images under 64 px."""
    if name == "small_cnn":
        return SmallCNN(in_channels, num_classes, norm=norm)
    if name in ("resnet18", "resnet50"):
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
        if image_size < 64:
            # ImageNet's stem (7x7 stride 2, max pool) cuts 32x32
            # images to 8x8; CIFAR's is one 3x3 stride-1 conv.
            model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        elif in_channels != 3:
            model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        return model
    raise ValueError(f"unknown model {name!r}")
