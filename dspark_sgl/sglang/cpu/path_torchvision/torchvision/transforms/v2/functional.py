"""Import-only stand-in."""

from torchvision import stub_getattr

__getattr__ = stub_getattr("torchvision.transforms.v2.functional")
