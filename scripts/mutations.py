"""Check that the tests bite: apply named mutations to a copy of the source, one at a time, run the tests that
should catch each, and print which survived (a mutation survives when its tests still pass). The serving ones run
in .venv-vllm (scripts/setup-vllm.sh).

    .venv/bin/python scripts/mutations.py              # every mutation
    .venv/bin/python scripts/mutations.py --list       # their names
    .venv/bin/python scripts/mutations.py readouts-detached warm-start-ignored

The checkout is copied (its tracked and untracked files) into a temporary folder, which comes first on the path
of every test process, so the mutations never touch the checkout. The copy's tests first run unmutated: a
mutation counts as caught only if they pass there. The exit status is 1 if any mutation survived.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the wrong behaviour, in words
    file: str
    edits: tuple[tuple[str, str], ...]  # (text, its replacement), each text found exactly once in `file`
    tests: tuple[str, ...]  # pytest node ids that must fail with the mutation
    options: tuple[str, ...] = ()  # more pytest options (--dtype bfloat16)
    python: str | None = None  # the interpreter, relative to the checkout (.venv-vllm/bin/python); default: this one


MUTATIONS = (
    Mutation(
        "warm-start-ignored",
        "generate(warm_start=True) starts every token from a fresh s_0",
        "recurfit/model/modeling.py",
        (("if initial_state is None and warm_start and decoding", "if initial_state is None and False and decoding"),),
        ("tests/test_generation_text.py::test_warm_start_starts_each_token_from_the_previous_final_state",),
    ),
    Mutation(
        "add-adapter-drops-the-state",
        "the add adapter returns e alone: every depth computes the first step",
        "recurfit/model/adapter.py",
        (
            ("        return state + embedded\n", "        return embedded\n"),
            ("        return state + part\n", "        return part\n"),
        ),
        ("tests/test_surgery_parity.py::test_add_adapter_with_zero_state_equals_pruned_parent_at_one_step",),
        ("--dtype", "bfloat16"),
    ),
    Mutation(
        "checkpointing-freezes-the-adapter",
        "activation checkpointing cuts the adapter out of the graph",
        "recurfit/model/compat.py",
        (
            (
                '    options = {"use_reentrant": False}\n',
                '    options = {"use_reentrant": False}\n    model.model.adapter.requires_grad_(False)\n',
            ),
        ),
        ("tests/test_model_modeling.py::test_gradient_checkpointing_gives_the_same_gradients",),
    ),
    Mutation(
        "checkpointing-scales-gradients",
        "checkpointed gradients are 0.9 of the true ones (caught in bf16 too)",
        "recurfit/model/compat.py",
        (
            (
                '    options = {"use_reentrant": False}\n',
                '    options = {"use_reentrant": False}\n'
                "    for p in model.parameters():\n"
                "        p.register_hook(lambda grad: grad * 0.9)\n",
            ),
        ),
        ("tests/test_model_modeling.py::test_gradient_checkpointing_gives_the_same_gradients",),
        ("--dtype", "bfloat16"),
    ),
    Mutation(
        "readouts-detached",
        "the depth task's trace reads each recurrence out without gradient",
        "recurfit/model/modeling.py",
        (("self._coda(state, layer_kwargs))\n", "self._coda(state.detach(), layer_kwargs))\n"),),
        ("tests/test_train_depth_task.py::test_the_trace_loss_averages_each_recurrence_with_gradient",),
    ),
    Mutation(
        "exit-never-settles",
        "an adaptive-exit rule whose rows never settle: every token runs the full depth",
        "recurfit/generation/exit.py",
        ((" = self.done | settled  #", " = self.done | (settled & False)  #"),),
        ("tests/test_generation_exit.py::test_adaptive_depth_reports_steps_and_never_exits_at_threshold_zero",),
    ),
    Mutation(
        "math-verdict-inverted",
        "the demo's report says more recurrence answers more when it answers fewer",
        "recurfit/demo/report.py",
        (("    if gain <= 0:\n", "    if gain >= 0:\n"),),
        ("tests/test_demo.py::test_the_math_verdict_follows_the_accuracies",),
    ),
    Mutation(
        "worked-verdict-inverted",
        "the demo's report says deeper r finishes more answers when it finishes fewer",
        "recurfit/demo/report.py",
        (("worked[r][1] > worked[first][1]", "worked[r][1] < worked[first][1]"),),
        ("tests/test_demo.py::test_the_worked_answers_verdict_compares_the_deeper_r_with_r_1",),
    ),
    Mutation(
        "english-verdict-inverted",
        "the demo's report says English is kept when the prose loss rose",
        "recurfit/demo/report.py",
        (("        if after <= before\n", "        if after >= before\n"),),
        ("tests/test_demo.py::test_the_english_verdict_follows_the_prose_losses",),
    ),
    Mutation(
        "rope-frequencies-not-sent",
        "under FSDP2 the processes that build on the meta device keep uninitialised RoPE frequencies",
        "recurfit/train/distributed.py",
        (("            dist.broadcast(buffer, src=0)\n", "            pass\n"),),
        ("tests/test_train_distributed.py::test_two_processes_build_on_the_meta_device_with_the_weights_of_one",),
    ),
    Mutation(
        "compile-auto-everywhere",
        "compile: auto compiles training on a CPU too",
        "recurfit/train/loop.py",
        (('    return device_type == "cuda" if choice == "auto" else bool(choice)', "    return bool(choice)"),),
        ("tests/test_train_loop.py::test_compile_auto_compiles_on_a_gpu_only_and_the_start_says_so",),
    ),
    Mutation(
        "rope-left-in-float32",
        "a bf16 retrofit's RoPE leaves queries and keys in float32 beside bf16 values (flex_attention wrong on CUDA)",
        "recurfit/model/modeling.py",
        (("        if not self._autocasts_itself():\n            return rope\n", "        return rope\n"),),
        ("tests/test_surgery_parity.py::test_attention_gets_queries_keys_and_values_of_one_dtype_in_low_precision",),
    ),
    Mutation(
        "split-op-left-out",
        "vLLM's piecewise graphs do not split at the core's attention: every step would replay step 1's",
        "recurfit/serving/pieces.py",
        (("compilation.splitting_ops = [*ops, STEPPED_ATTENTION]", "compilation.splitting_ops = list(ops)"),),
        (
            "tests/test_vllm.py::test_the_core_attention_op_is_added_to_the_splitting_ops_vllm_chose",
            "tests/test_vllm.py::test_under_vllms_piecewise_cuda_graph_contract_each_request_gets_its_depths_tokens",
        ),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "attention-op-returns-its-output",
        "the core's attention op is declared as writing nothing, so the compiler may drop its write",
        "recurfit/serving/attention.py",
        (
            (
                '@torch.library.custom_op(STEPPED_ATTENTION, mutates_args=("output",))',
                "@torch.library.custom_op(STEPPED_ATTENTION, mutates_args=())",
            ),
        ),
        ("tests/test_vllm.py::test_the_core_attention_op_writes_into_an_output_the_compiled_region_allocated",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "attention-output-allocated-outside-the-graphs",
        "the core's attention op returns a tensor it allocates between graph segments (new at each replay), as "
        "before vLLM's rule was held",
        "recurfit/serving/attention.py",
        (
            (
                '@torch.library.custom_op(STEPPED_ATTENTION, mutates_args=("output",))\n'
                "def stepped_attention(\n"
                "    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer: str\n"
                ") -> None:",
                "@torch.library.custom_op(STEPPED_ATTENTION, mutates_args=())\n"
                "def stepped_attention(\n"
                "    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: str\n"
                ") -> torch.Tensor:",
            ),
            (
                "    output.copy_(get_forward_context().no_compile_layers[layer].attend(query, key, value))",
                "    return get_forward_context().no_compile_layers[layer].attend(query, key, value)",
            ),
            (
                "def _(query, key, value, output, layer) -> None:\n    return None",
                "def _(query, key, value, layer):\n    return torch.empty_like(query)",
            ),
            (
                "        stepped_attention(query, key, value, output, self.layer_name)\n        return output",
                "        return stepped_attention(query, key, value, self.layer_name)",
            ),
        ),
        ("tests/test_vllm.py::test_under_vllms_piecewise_cuda_graph_contract_each_request_gets_its_depths_tokens",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "whole-batch-step-off-the-buffer",
        "a core step over the whole batch hands the next one its own output, not the buffer its graph reads",
        "recurfit/serving/vllm_model.py",
        (
            (
                'running = pieces.fixed("state", pieces.core_step(running_positions, running, running_part))',
                "running = pieces.core_step(running_positions, running, running_part)",
            ),
        ),
        (
            "tests/test_vllm.py::test_under_cuda_graphs_each_piece_reads_fixed_addresses_and_partial_steps_run_"
            "without_graphs",
        ),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "kept-keys-zeroed",
        "on backends whose metadata is not narrowed (GPU ones), the tokens past their depth write zeros as keys",
        "recurfit/serving/attention.py",
        (
            (
                "        key = kept_key.index_copy(0, rows, key)",
                "        key = torch.zeros_like(kept_key).index_copy(0, rows, key)",
            ),
        ),
        (
            "tests/test_vllm.py::test_attention_over_every_token_as_on_gpu_backends_gives_each_request_its_depths_tokens[latest]",
        ),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "narrowed-slots-of-the-first-tokens",
        "a step's narrowed attention metadata takes the first tokens' cache slots, not the recurring requests'",
        "recurfit/serving/attention.py",
        (
            (
                "        slot_mapping=whole.slot_mapping[rows],",
                "        slot_mapping=whole.slot_mapping[: rows.numel()],",
            ),
        ),
        ("tests/test_vllm.py::test_narrowed_metadata_is_what_the_backends_own_builder_gives_for_those_requests_alone",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "cache-not-salted-by-depth",
        "the engine's scheduler leaves a request's cache salt alone: a request reads blocks written at another depth",
        "recurfit/serving/scheduler.py",
        (("        salt_by_depth(request, self.depth_limits)\n", "        pass\n"),),
        (
            "tests/test_vllm.py::test_without_the_middleware_no_route_reads_cache_blocks_written_at_another_depth",
            "tests/test_vllm.py::test_a_mixed_depth_batch_gives_each_request_generates_tokens_at_its_depth[llama-eager]",
        ),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "breakable-graphs-allowed",
        "VLLM_USE_BREAKABLE_CUDAGRAPH=1 serves every request at the captured depth",
        "recurfit/serving/engine.py",
        (("        _no_breakable_cuda_graphs()\n", ""),),
        ("tests/test_vllm.py::test_breakable_cuda_graphs_are_refused_and_opted_out_of_before_vllm_turns_them_on",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "fsdp-group-kept-alive",
        "Processes.close destroys the group while DTensor's caches still hold it (a finished run may abort)",
        "recurfit/train/distributed.py",
        (("            _forget_dtensor_caches()\n", "            pass\n"),),
        (
            "tests/test_train_distributed.py::test_closing_the_processes_ends_the_gloo_threads_before_the_interpreter_exits",
        ),
    ),
)


def copy_checkout(target: Path) -> None:
    """The checkout's tracked and untracked (not ignored) files, copied into `target`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = REPO / name.decode()
        if source.is_file():
            (target / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name.decode())


def run_tests(root: Path, mutation: Mutation) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the copy's recurfit, before the checkout's editable install
    python = str(REPO / mutation.python) if mutation.python else sys.executable
    command = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.options]
    return subprocess.run([*command, *mutation.tests], cwd=root, env=env, capture_output=True, text=True)


def apply(root: Path, mutation: Mutation) -> str:
    """Apply `mutation` in the copy at `root`; returns the file's original text."""
    path = root / mutation.file
    original = text = path.read_text()
    for old, new in mutation.edits:
        if text.count(old) != 1:
            raise SystemExit(f"{mutation.name}: {old!r} occurs {text.count(old)} times in {mutation.file}, not once")
        text = text.replace(old, new)
    path.write_text(text)
    return original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="the mutations to try (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()
    if args.list:
        for mutation in MUTATIONS:
            print(f"{mutation.name}: {mutation.what}")
        return
    unknown = set(args.names) - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutations: {', '.join(sorted(unknown))} (see --list)")
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    survived = []
    with tempfile.TemporaryDirectory(prefix="mutations-") as folder:
        root = Path(folder)
        copy_checkout(root)
        for mutation in chosen:
            baseline = run_tests(root, mutation)
            if baseline.returncode != 0:
                raise SystemExit(f"{mutation.name}: its tests fail without the mutation:\n{baseline.stdout[-2000:]}")
            original = apply(root, mutation)
            try:
                mutated = run_tests(root, mutation)
            finally:
                (root / mutation.file).write_text(original)
            caught = mutated.returncode != 0
            if not caught:
                survived.append(mutation.name)
            last = mutated.stdout.strip().splitlines()[-1] if mutated.stdout.strip() else ""
            print(f"{'caught  ' if caught else 'SURVIVED'} {mutation.name}: {mutation.what} ({last})", flush=True)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations caught")
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
