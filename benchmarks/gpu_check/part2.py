"""Part 2: the CUDA tests (`pytest --device cuda`) in float32 and bfloat16, as command steps, on the test files
that tests/device_modules.py names."""

from __future__ import annotations

import runpy

from .common import DEVICE, PART_BUDGET, REPO, BenchSizes, Part, Step, pytest_command
from .smoke import SMOKE_TESTS

# The test files that --device/--dtype move (tests/device_modules.py, which tests/conftest.py reads too): the
# model and generation ones run in fp32 and bf16; the training ones in fp32, distributed and healing in part 4.
_MODULES = runpy.run_path(str(REPO / "tests" / "device_modules.py"))
DEVICE_TESTS = [f"tests/{name}.py" for name in sorted(_MODULES["DTYPE_MODULES"])]
_OWN_STEPS = {"test_train_distributed", "test_train_losses"}
TRAINING_TESTS = [f"tests/{name}.py" for name in sorted(_MODULES["TRAINING_MODULES"] - _OWN_STEPS)]


def device_tests(b: BenchSizes, dtype: str) -> list:
    files = SMOKE_TESTS if b.smoke else [*DEVICE_TESTS, *(TRAINING_TESTS if dtype == "float32" else [])]
    return pytest_command(b, "--dtype", dtype, *files, "--junitxml", b.work / f"junit-{dtype}.xml")


PART = Part(
    "the CUDA tests in float32 and bfloat16",
    (
        DEVICE,
        Step(
            "tests-fp32",
            330,
            "pytest --device cuda: model, cache, generation, training tests",
            lambda b: device_tests(b, "float32"),
        ),
        Step(
            "tests-bf16",
            150,
            "the same under --dtype bfloat16, training's left out",
            lambda b: device_tests(b, "bfloat16"),
        ),
    ),
    PART_BUDGET,
    6,
)
