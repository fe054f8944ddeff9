"""The GPU check's CPU smoke (`--cpu-smoke`): the toy Llama its steps build (the sweep's everywhere), part 1's
toy sizes, its limits' scale, the quick tests it runs in place of parts 2 and 4's, and the folder whose
sitecustomize hides the packages the device machine lacks."""

from __future__ import annotations

from pathlib import Path

from train_setup import TOY_LLAMA

from .common import MISSING_ON_DEVICE, Sizes

# The smoke's parent, and the sweep's everywhere: a toy Llama.
TOY_PARENT = dict(
    TOY_LLAMA,
    vocab_size=256,
    num_hidden_layers=4,
    max_position_embeddings=512,
    num_attention_heads=2,
    num_key_value_heads=1,
)
SMOKE_SCALE = 3  # the smoke's limits: a shared CI machine's CPU is slow to import and trace


def smoke_sizes() -> Sizes:
    return Sizes(
        device="cpu",
        dtype="fp32",
        parent=TOY_PARENT,
        shape=(1, 2, 1),
        compile=True,  # inductor, as on the GPU (without CUDA graphs on a CPU)
        peaks=dict(size=256, copy_gib=0.01, repeats=2),
        check=dict(batch=1, prompt=8, new=6, eager=(1, 2, 4), compiled=(1, 2, 4)),
        decode=dict(keys=((1, 2), (1, 4), (2, 4), (2, 2)), prompt=8, new=6, repeats=1),
        train=dict(
            seq_len=32,
            steps=1,
            overrides=(
                "model.shape=[1,2,1]",
                "batch.micro=1",
                "batch.global=2",
                "depth.mean_recurrence=4",
                "depth.backprop_depth=2",
            ),
            memory=2 * 10**9,
        ),
    )


# The smoke's tests: the options' plumbing on two quick tests, and two of the healing objectives'.
SMOKE_TESTS = ("tests/test_surgery_parity.py", "-k", "where_the_options or attention_implementations and sdpa")
SMOKE_HEALING = ("-k", "hand_computation or weighted_mean")


def hide_device_missing(work: Path) -> Path:
    """A folder whose sitecustomize makes the packages the device lacks unimportable, as they are there."""
    folder = work / "hide"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n\n\nclass Missing:\n"
        f"    names = {MISSING_ON_DEVICE!r}\n\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in self.names:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (hidden: the GPU machine lacks it)')\n\n\n"
        "sys.meta_path.insert(0, Missing())\n"
    )
    return folder
