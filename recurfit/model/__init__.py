"""The recurrent model: what it is, how it runs, how it is counted and loaded.

- config.py      RecurrentConfig: shape, adapter, σ, mean recurrence; embeds the parent family's config
- modeling.py    RecurrentForCausalLM: prelude → (adapter + core) × r → coda, from the family's own layers
- adapter.py     the adapter A([s; e]) before each core step (linear, or the "add" ablation)
- layer_inputs.py  position ids from the attention mask; a batch's layer inputs cut to some rows
- cache.py       RecurrentCache: the step-aware KV cache (latest-step rule, memory policies)
- sampling.py    the training depth sampler, the curricula, DepthSchedule, `num_steps` parsing
- accounting.py  parameter counts (the paper's conventions) and FLOPs
- init.py        the scaled (Takase) random init of the paper's random-init baseline
- families.py    the supported parent families and their quirks
- loading.py     models and tokenizers by path or Hub id (load_model), devices and precision (resolve_placement)
- tables.py      the rich tables `inspect` and `train` print (parts, parameters, FLOPs, layer scores)
- card.py        model cards (README.md) for saved models, and `recurfit push`

Nothing is imported here: each module is imported where it is used, so `recurfit --help` stays torch-free.
"""
