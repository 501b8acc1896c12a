"""Stub of torchvision.transforms: the InterpolationMode enum transformers reads at import, nothing else."""

import enum

from torchvision import stub_getattr


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = stub_getattr("torchvision.transforms", {"functional", "v2"})
