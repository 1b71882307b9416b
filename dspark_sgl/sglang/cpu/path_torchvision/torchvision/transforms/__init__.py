"""Import-only stand-in: names exist so module-level imports succeed; nothing works."""

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


__getattr__ = stub_getattr("torchvision.transforms")
