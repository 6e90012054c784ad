"""The test suite: tests mirror the packages; ``tests.support`` holds what they share."""
