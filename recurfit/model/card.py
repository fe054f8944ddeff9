"""Model cards (the README.md of a saved model folder) and `recurfit push`, as people share models on the Hub.

`retrofit --out`, `import-raven --out` and a training run's `final/` folder each get a README.md: the parent, the
shape and which parent layers each part came from, parameter counts, the training recipe and tokens (for a trained
model), the last validation table (if the run validated) and how to load the model. `push` uploads a folder with
`huggingface_hub.upload_folder`.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..defaults import SUMMARY_RECURRENCES
from ..errors import RecurfitError
from ..io.assets import EMBEDDED_NAME, cache_root
from .accounting import count_parameters, effective_parameters
from .modeling import RecurrentForCausalLM
from .tables import layer_ranges

CARD = "README.md"
# What a model folder shares: weights, configs, tokenizer, the card. Checkpoints, logs and stray files stay home.
# A run's last validation as table cells: (step, column names such as "r=4", the cells of each store's row).
Validation = tuple[int, list[str], dict[str, list[str]]]

UPLOADED = ["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja", CARD]


def parent_name(name_or_path: str | None) -> str:
    """The parent as a reader knows it: the embedded model by name rather than by its cache folder."""
    if not name_or_path:
        return "a local model"  # its folder is not recorded: the path would be published with the card
    return EMBEDDED_NAME if Path(name_or_path).is_relative_to(cache_root()) else str(name_or_path)


def _hub_id(name: str) -> str | None:
    """`base_model` metadata only for what looks like a Hub id (owner/name), not a local folder."""
    return name if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not Path(name).exists() else None


def model_card(model, name: str, training: dict | None = None, validation: Validation | None = None) -> str:
    """The card's text. `training`: {"config": TrainConfig.to_dict(), "steps", "tokens", "flops"};
    `validation`: the run's last validation as table cells."""
    config = model.config
    parent = parent_name(getattr(config, "parent_name_or_path", None) or getattr(config, "_name_or_path", None))
    recurrent = isinstance(model, RecurrentForCausalLM)
    tags = ["recurfit", "depth-recurrence"] if recurrent else ["recurfit"]
    data = ModelCardData(library_name="transformers", tags=tags, base_model=_hub_id(parent))
    sections = [f"# {name}", _summary(model, parent, recurrent), _structure(model, recurrent)]
    if training:
        sections.append(_training(training))
    if validation:
        sections.append(_validation(validation))
    sections.append(_loading(recurrent))
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"


def write_model_card(
    folder: str | Path, model, name: str, training: dict | None = None, validation: Validation | None = None
) -> Path:
    """README.md in `folder` (a saved model, maybe still being staged), headed `name`."""
    path = Path(folder) / CARD
    ModelCard(model_card(model, name, training, validation)).save(path)
    return path


def _summary(model, parent: str, recurrent: bool) -> str:
    if not recurrent:
        return f"A {model.config.model_type} model (not depth-recurrent) saved by recurfit; parent: {parent}."
    config = model.config
    return (
        f"A depth-recurrent model retrofitted by recurfit from **{parent}**: prelude → "
        f"(adapter + core) × r → coda, shape {tuple(config.shape)}. The core runs r times per token; r is chosen "
        f"at test time (default: the config's mean recurrence, {config.mean_recurrence}; training backprop depth "
        f"{config.backprop_depth})."
    )


def _structure(model, recurrent: bool) -> str:
    counts = count_parameters(model)
    lines = ["## Shape and parameters", "", "| part | parent layers | parameters |", "|---|---|---|"]
    if recurrent:
        source = model.config.source_layers or {}
        for part in ("prelude", "core", "coda"):
            layers = source.get(part)
            lines.append(f"| {part} | {layer_ranges(layers)} | {counts[part]:,} |")
        lines.append(f"| adapter ({model.config.adapter}) | | {counts['adapter']:,} |")
    else:
        lines.append(f"| layers ({model.config.num_hidden_layers}) | all | {counts['layers']:,} |")
    lines += [f"| embeddings (in + out) | | {counts['embeddings']:,} |", f"| total | | {counts['total']:,} |"]
    if recurrent:
        depths = ", ".join(f"r={r}: {effective_parameters(counts, r) / 1e6:,.1f} M" for r in SUMMARY_RECURRENCES)
        lines += ["", f"Effective (non-embedding) parameters per token: {depths}."]
    return "\n".join(lines)


def _training(training: dict) -> str:
    config = training["config"]
    phases = config.get("data", {}).get("phases", [])
    depth, optimizer = config.get("depth", {}), config.get("optimizer", {})
    batch = config.get("batch", {}).get("global")
    summary = (
        f"{training['steps']:,} optimizer steps, {training['tokens']:,} tokens, {training['flops']:.3e} training "
        f"FLOPs (from the depths drawn), by `recurfit train` in global batches of {batch} rows, from these data phases:"
    )
    lines = ["## Training", "", summary, ""]
    for index, phase in enumerate(phases, 1):
        sources = ", ".join(f"{s['path']} (weight {s.get('weight', 1)})" for s in phase.get("sources", []))
        budget = f"{phase['tokens']:,} tokens" if phase.get("tokens") else "the rest of the run"
        lines.append(f"{index}. {sources}: {budget}")
    recipe = (
        f"Depth: mean recurrence {depth.get('mean_recurrence')} ({depth.get('curriculum')} curriculum), backprop "
        f"depth {depth.get('backprop_depth')}. Optimizer: {optimizer.get('name')}. The full config is below."
    )
    lines += [
        "",
        recipe,
        "",
        "```yaml",
        _yaml(config).rstrip(),
        "```",
    ]
    return "\n".join(lines)


def _yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)


def _validation(validation: Validation) -> str:
    """The last validation of the run: a row per store, a column per test recurrence."""
    step, columns, rows = validation
    lines = [
        f"## Validation loss (nats/token, step {step})",
        "",
        "| data | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    lines += [f"| {store} | " + " | ".join(cells) + " |" for store, cells in rows.items()]
    return "\n".join(lines)


def _loading(recurrent: bool) -> str:
    steps = ", num_steps=8" if recurrent else ""
    return "\n".join(
        [
            "## Use",
            "",
            'recurfit is not on PyPI: install it from its repository, `pip install "recurfit @ git+URL"` (URL: the '
            "repository's git address), or `pip install ./recurfit` from a clone.",
            "",
            "```python",
            "import recurfit  # registers the model type with transformers' Auto classes",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            'model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO_ID")',
            'tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO_ID")',
            'ids = tokenizer("The capital of France is", return_tensors="pt").input_ids',
            f"print(tokenizer.decode(model.generate(ids, max_new_tokens=20{steps})[0]))",
            "```",
            "",
            'Or from the command line: `recurfit generate PATH_OR_REPO_ID --prompt "…"`'
            + (" (`--recurrence R` sets r)." if recurrent else "."),
        ]
    )


def files_to_upload(folder: str | Path) -> list[str]:
    """The files `push` sends, relative to `folder` (what `upload_folder` with UPLOADED as allow_patterns sends)."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    names = sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())
    return list(filter_repo_objects(names, allow_patterns=UPLOADED))


def push(folder: str | Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Create the Hub repository (if needed) and upload the model folder; the commit's URL."""
    from huggingface_hub import create_repo, upload_folder

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise RecurfitError(
            f"{folder} is not a saved model (no config.json): push a retrofit --out or runs/NAME/final."
        )
    if not (folder / CARD).is_file():
        raise RecurfitError(f"{folder} has no {CARD} model card: re-save it with recurfit, or write one, then push.")
    create_repo(repo_id, private=private, exist_ok=True, token=token)
    info = upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        allow_patterns=UPLOADED,
        token=token,
        commit_message="Upload a recurfit model",
    )
    return str(info)
