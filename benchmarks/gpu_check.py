"""The GPU check's command line: `python benchmarks/gpu_check.py [--part N|all] [--plan] [--cpu-smoke] --out OUT`
runs the package benchmarks/gpu_check/ (its runner's docstring says what the check measures and how it is run);
the runner runs this file with `--step NAME` for each step that is a function, in a process of its own."""

import sys

# Run as a script, benchmarks/ is sys.path[0], where the package benchmarks/gpu_check/ comes before this file for
# `import gpu_check`. Loaded from its path under the package's name (tests/test_docs.py does), this file holds that
# name in sys.modules: it makes way for the package.
if sys.modules.get("gpu_check") is sys.modules.get(__name__):
    del sys.modules["gpu_check"]

from gpu_check.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
