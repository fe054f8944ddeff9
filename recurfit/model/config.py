"""`RecurrentConfig`: the configuration of a depth-recurrent LM made from a parent family's layers."""

from __future__ import annotations

from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..defaults import ADAPTERS, BACKPROP_DEPTH, DEFAULT_STATE_INIT_STD, MEAN_RECURRENCE
from .shape import shape_problem


class RecurrentConfig(PreTrainedConfig):
    r"""A prelude of `num_prelude_layers`, a core of `num_core_layers` looped r times, a coda of `num_coda_layers`.

    `text_config` is the parent family's own config describing the kept decoder layers in execution order
    (prelude, then core, then coda): its `num_hidden_layers` is their total and its per-layer fields follow
    them. `source_layers` ({"prelude": [...], "core": [...], "coda": [...]}) and `parent_name_or_path` record
    where each part came from.

    `embedding_scale` multiplies the token embeddings (Huginn's `emb_scale`, used by the paper's random-init
    baseline); None keeps the family's convention.

    Recurrence: `s_0 ~ TruncNormal(0, state_init_std², ±3σ)` (zeros when 0), `s_i = core(adapter([s_{i-1}; e]))`.
    `mean_recurrence` (r̄) is the default test-time r and the training sampler's mean; `backprop_depth` (k̄)
    is the number of final steps that receive gradient in training.

    `depth_for_effort` maps a chat request's `reasoning_effort` (low, medium, high) to a recurrence when the model
    is served with vLLM (recurfit.serving.depth); `recurfit train` writes the defaults of its r̄
    (`defaults.depth_for_effort`), and None leaves them to the server.
    """

    model_type = "recurfit"
    sub_configs = {"text_config": AutoConfig}
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the KV cache, by either transformers name

    text_config: dict | PreTrainedConfig | None = None
    num_prelude_layers: int = 2
    num_core_layers: int = 4
    num_coda_layers: int = 2
    source_layers: dict | None = None
    parent_name_or_path: str | None = None
    adapter: str = "linear"
    state_init_std: float = DEFAULT_STATE_INIT_STD
    mean_recurrence: int = MEAN_RECURRENCE
    backprop_depth: int = BACKPROP_DEPTH
    embedding_scale: float | None = None  # token embeddings × this; None: the family's own (Gemma: sqrt(h))
    depth_for_effort: dict | None = None  # reasoning_effort → recurrence when served; None: the server's defaults
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        total = self.num_prelude_layers + self.num_core_layers + self.num_coda_layers
        if isinstance(self.text_config, dict):
            text = dict(self.text_config)
            self.text_config = CONFIG_MAPPING[text.pop("model_type", "llama")](**text)
        elif self.text_config is None:
            self.text_config = CONFIG_MAPPING["llama"](num_hidden_layers=total)
        self._validate(total)
        super().__post_init__(**kwargs)

    def _validate(self, total: int) -> None:
        problem = shape_problem((self.num_prelude_layers, self.num_core_layers, self.num_coda_layers))
        if problem:
            raise ValueError(f"RecurrentConfig's {problem} (num_prelude_layers, num_core_layers, num_coda_layers).")
        if self.text_config.num_hidden_layers != total:
            raise ValueError(
                f"text_config describes {self.text_config.num_hidden_layers} layers but the shape "
                f"({self.num_prelude_layers}, {self.num_core_layers}, {self.num_coda_layers}) needs {total}."
            )
        if self.adapter not in ADAPTERS:
            raise ValueError(f"adapter must be one of {ADAPTERS}, got {self.adapter!r}.")
        if self.embedding_scale is not None and not self.embedding_scale > 0:
            raise ValueError(f"embedding_scale must be > 0 (or None for the family's own), got {self.embedding_scale}.")
        if not self.state_init_std >= 0:
            raise ValueError(f"state_init_std must be >= 0 (0 means a zero initial state), got {self.state_init_std}.")
        if self.mean_recurrence < 1 or self.backprop_depth < 1:
            raise ValueError(
                "mean_recurrence and backprop_depth must be >= 1, "
                f"got {self.mean_recurrence} and {self.backprop_depth}."
            )
        effort = self.depth_for_effort
        if effort is not None and not (
            isinstance(effort, dict)
            and all(isinstance(k, str) and type(v) is int and v >= 1 for k, v in effort.items())
        ):
            raise ValueError(f"depth_for_effort must map effort names to integers >= 1 (or be None), got {effort!r}.")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_prelude_layers, self.num_core_layers, self.num_coda_layers)

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size


# Importing the config makes model_type "recurfit" known to AutoConfig (modeling.py does the same for the models).
AutoConfig.register(RecurrentConfig.model_type, RecurrentConfig, exist_ok=True)
