"""Stub of torchvision.transforms.v2."""

from torchvision import stub_getattr
from torchvision.transforms import InterpolationMode

__all__ = ["InterpolationMode"]
__getattr__ = stub_getattr("torchvision.transforms.v2", {"functional"})
