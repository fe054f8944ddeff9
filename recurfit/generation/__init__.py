"""Generation: turning a recurrent model into text, and the decoding modes beyond plain `generate`.

    text.py         settings, completion and chat prompts, `generate_text` (CLI, chat, demo)
    exit.py         adaptive depth: `ExitRule` ("kl:5e-4", "argmax:3") and its per-forward tracker
    speculative.py  self-speculative decoding: draft at a small recurrence, verify at the full one

The model side (the step-aware KV cache, the recurrence loop that drops settled rows, warm starts) lives in
`recurfit.model.cache` and `recurfit.model.modeling`; this package passes it objects and never the reverse.
"""

from .exit import ExitRule
from .text import Generation, GenerationSettings, chat_ids, generate_text, prompt_ids

__all__ = ["ExitRule", "Generation", "GenerationSettings", "chat_ids", "generate_text", "prompt_ids"]
