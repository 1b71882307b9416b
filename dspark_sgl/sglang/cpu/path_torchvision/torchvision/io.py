"""Import-only stand-in."""

import enum

from torchvision import stub_getattr


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


__getattr__ = stub_getattr("torchvision.io")
