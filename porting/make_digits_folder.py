"""Write the repository's offline digits as an image folder for torchvision's ImageFolder.

    usage: python porting/make_digits_folder.py DIR

DIR/train/<digit>/<n>.png and DIR/test/<digit>/<n>.png: the 1,797 real 8x8 handwritten digits of
common/digits.csv.gz (common/DIGITS.md says what they are and where they come from) as grayscale
PNGs. A fixed 359 of them (20%) go to test/, the other 1,438 to train/.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# make `common` importable: after this file's folder, so a common/ copied beside it comes first
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from common.data import DIGITS_TEST_FRACTION, digits_arrays

USAGE = "usage: python porting/make_digits_folder.py DIR"


def main():
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    root = Path(sys.argv[1])
    pixels, labels = digits_arrays()  # pixels count ink, 0..16
    images = np.round(pixels * 255 / 16).astype(np.uint8)
    # the same order on every run
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234)).tolist()
    n_test = int(len(labels) * DIGITS_TEST_FRACTION)
    for split, indices in (("test", order[:n_test]), ("train", order[n_test:])):
        for index in indices:
            folder = root / split / str(labels[index])
            folder.mkdir(parents=True, exist_ok=True)
            # uint8, one channel: an 8-bit grayscale ("L") PNG, named by its row in the data set
            Image.fromarray(images[index]).save(folder / f"{index:04d}.png")
        print(f"{root / split}: {len(indices)} images")


if __name__ == "__main__":
    main()
