"""The power-cut fixture (FUSE, ../shared/powercut/lazyfs.py): skips with the reason where it cannot mount."""

from powercut_fixture import powercut  # noqa: F401
