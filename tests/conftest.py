"""The suite is the CPU suite: on a GPU host too, every test and every process it starts sees no
GPU (gloo, fp32, any number of ranks), as on CI. Set before anything initialises CUDA. A `make`
target the tests start takes no quick calibration before its runs (CALIBRATE=0: 15 s each),
but the test of that calibration itself."""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["CALIBRATE"] = "0"


def pytest_terminal_summary(terminalreporter):
    """The scripts past CONTRIBUTING's size, as a warning list (a long script still passes)."""
    from helpers import OWN_LINES_WARNING, scripts_over_own_lines

    if over := scripts_over_own_lines():
        terminalreporter.section(f"scripts over {OWN_LINES_WARNING} lines of their own "
                                 "(a warning: CONTRIBUTING asks about 300; copies aside)")
        for name, lines in over:
            terminalreporter.line(f"{lines:5d}  {name}")
