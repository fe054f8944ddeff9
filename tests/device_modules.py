"""The test modules that `pytest --device` and `--dtype` move off the CPU and float32, read by tests/conftest.py
and by benchmarks/gpu_check/part2.py (the GPU check's part 2, which runs them on the GPU). Torch-free: the check
reads it at import.
"""

# The test modules that follow --device (training runs through `recurfit train`, which picks the GPU itself)
# and --dtype (the models the tests build directly).
TRAINING_MODULES = {
    "test_model_init",
    "test_train_checkpoint",
    "test_train_config",
    "test_train_distributed",
    "test_train_initial_model",
    "test_train_loop",
    "test_train_losses",
    "test_train_optim",
    "test_train_run_folder",
}  # multi-process tests there are cpu_only
DEVICE_MODULES = {
    "test_cli_generate",
    "test_generation_exit",
    "test_generation_speculative",
    "test_generation_text",
    "test_model_cache",
    "test_model_compiled",
    "test_model_modeling",
    "test_model_static_cache",
    "test_model_shape",
    "test_surgery_parity",
    *TRAINING_MODULES,
}
DTYPE_MODULES = DEVICE_MODULES - TRAINING_MODULES
