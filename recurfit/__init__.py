"""recurfit: retrofit depth-recurrence into pretrained language models.

Importing recurfit registers `RecurrentConfig` / `RecurrentForCausalLM` (model_type "recurfit") with the
transformers Auto classes, so `AutoModelForCausalLM.from_pretrained(dir)` loads a saved recurrent model.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import RecurrentCache
from .accounting import count_parameters, effective_parameters, inference_flops_per_token, training_flops
from .config import RecurrentConfig
from .modeling import RecurrentForCausalLM, RecurrentModel
from .sampling import sample_depth
from .surgery import LayerSelection, retrofit

AutoConfig.register(RecurrentConfig.model_type, RecurrentConfig, exist_ok=True)
AutoModel.register(RecurrentConfig, RecurrentModel, exist_ok=True)
AutoModelForCausalLM.register(RecurrentConfig, RecurrentForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "LayerSelection",
    "RecurrentCache",
    "RecurrentConfig",
    "RecurrentForCausalLM",
    "RecurrentModel",
    "count_parameters",
    "effective_parameters",
    "inference_flops_per_token",
    "retrofit",
    "sample_depth",
    "training_flops",
]
