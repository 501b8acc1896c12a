"""Stub of torchvision.transforms.v2.functional."""

from torchvision import stub_getattr

__getattr__ = stub_getattr("torchvision.transforms.v2.functional")
