"""Scripts the tests run as child processes (``python -m tests.support.children.NAME``, from the repository root)."""
