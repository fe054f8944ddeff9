"""The GPU check's command line: `python benchmarks/gpu_check.py [--part N|all] [--plan] [--cpu-smoke] --out OUT`
runs the package benchmarks/gpu_check/ (its runner's docstring says what the check measures and how it is run);
the runner runs this file with `--step NAME` for each step that is a function, in a process of its own."""

import sys

# Run as a script, benchmarks/ is sys.path[0], where the package benchmarks/gpu_check/ comes before this file.
from gpu_check.runner import main

if __name__ == "__main__":
    sys.exit(main())
