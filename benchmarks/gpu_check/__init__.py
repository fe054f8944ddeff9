"""The GPU check, as a package: `python benchmarks/gpu_check.py …` (the entry script beside this folder) runs
runner.main, whose module docstring says what the check measures and how it is run. runner.py holds the command
line, the parts' table and the runner of a part's steps; part1.py to part5.py each hold one part's steps (its
Part, its command lines, and the functions of its steps that run as `--step NAME`); smoke.py holds the CPU smoke's
toy sizes and the hiding of the packages the device lacks; context.py what a step function knows; decoding.py what
part 1's decoding steps build and read; common.py the paths, the steps' and sizes' types and the result files
every module shares."""
