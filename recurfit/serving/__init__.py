"""Serving recurfit folders with vLLM: a model class and the plugin that registers it.

`pip install recurfit[vllm]` (or `scripts/setup-vllm.sh`) installs vLLM; its `vllm.general_plugins` entry point
then calls `register()` in every vLLM process, so `vllm serve RUN/final` and `vllm.LLM("RUN/final")` load a
saved recurfit folder as it is. Nothing here imports vLLM until vLLM itself calls in.
"""

from __future__ import annotations

ARCHITECTURE = "RecurrentForCausalLM"  # `architectures` in the config.json recurfit saves


def register() -> None:
    """The `vllm.general_plugins` entry point: make recurfit's config and model known to vLLM (idempotent)."""
    from vllm import ModelRegistry

    import recurfit.model.config  # noqa: F401  (importing it registers model_type "recurfit" with AutoConfig)

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "recurfit.serving.vllm_model:RecurfitForCausalLM")
