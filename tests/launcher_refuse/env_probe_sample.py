"""A negative control for tests/test_rank_launcher.py's import-time environment check."""
import os

AT_IMPORT = os.environ.get("XDIT_SAMPLE")  # read while importing: found


def later():
    return os.environ.get("XDIT_SAMPLE")  # read when called: fine
