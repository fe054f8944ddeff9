"""Check that the tests bite: apply named mutations to a copy of the source, one at a time, run the tests that
should catch each, and print which survived (a mutation survives when its tests still pass). The serving ones run
in .venv-vllm (scripts/setup-vllm.sh).

    .venv/bin/python scripts/mutations.py              # every mutation
    .venv/bin/python scripts/mutations.py --list       # their names
    .venv/bin/python scripts/mutations.py readouts-detached warm-start-ignored

The checkout is copied (its tracked and untracked files) into a temporary folder, which comes first on the path
of every test process, so the mutations never touch the checkout. Each mutation's tests first run unmutated and must
all pass there; with the mutation every test it names runs (no -x) and a mutation counts as caught only when each of
them fails a check (an assert, pytest.raises or pytest.fail): a test that crashes, errors in its setup, is skipped or
runs past the mutation's time limit does not catch it. The exit status is 1 if any mutation survived.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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
    timeout: int = 600  # seconds for a run of its tests (unmutated, then mutated)


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
        "draft-times-never-decay",
        "self-speculation's round times average the whole run: a device that turns compute-bound keeps drafting",
        "recurfit/generation/speculative.py",
        (("self.times = {d: _Decayed(self.DECAY)", "self.times = {d: _Decayed(1.0)"),),
        ("tests/test_generation_speculative.py::test_draft_length_follows_a_device_whose_round_times_change",),
    ),
    Mutation(
        "draft-no-periodic-plain-step",
        "self-speculation never takes a plain step again while drafting pays: t(0) is never measured again",
        "recurfit/generation/speculative.py",
        (("or self.since_plain >= self.MAX_WAIT)", "or False)"),),
        ("tests/test_generation_speculative.py::test_draft_length_follows_a_device_whose_round_times_change",),
    ),
    Mutation(
        "draft-no-interpolation",
        "self-speculation prices a draft count not yet run by the per-draft prior, not between the measured ones",
        "recurfit/generation/speculative.py",
        (("        if not above:\n", "        if True:\n"),),
        (
            "tests/test_generation_speculative.py::test_draft_length_interpolates_a_draft_count_not_run_between_the_measured_ones",
        ),
    ),
    Mutation(
        "draft-back-off-never-resets",
        "self-speculation's back-off keeps the longest wait it reached once drafting paid again",
        "recurfit/generation/speculative.py",
        (("            self.next_wait = 2\n", "            pass\n"),),
        (
            "tests/test_generation_speculative.py::test_draft_length_backs_off_while_rejected_and_recovers_when_accepted",
        ),
    ),
    Mutation(
        "draft-times-never-forgotten",
        "self-speculation keeps round times measured long ago: a device that turned dear and cheap again drafts one",
        "recurfit/generation/speculative.py",
        (("            return fresh\n", "            return measured\n"),),
        (
            "tests/test_generation_speculative.py::test_draft_length_drafts_the_full_lookahead_again_when_a_device_turns_cheap_again",
        ),
    ),
    Mutation(
        "latest-with-speculation",
        "cache_policy 'latest' served with speculative decoding: a verify step reads its drafts' same-step keys",
        "recurfit/serving/engine.py",
        (('("speculative decoding", "no --speculative-config", verifies)', '("speculative decoding", "", False)'),),
        (
            "tests/test_vllm.py::test_latest_policy_is_refused_where_a_token_would_read_same_step_keys_of_its_own_request",
        ),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "latest-with-preemption",
        "cache_policy 'latest' served with a KV cache vLLM may preempt in: a recomputed request's tokens change",
        "recurfit/serving/scheduler.py",
        (("    if fit < seqs:\n", "    if False:\n"),),
        (
            "tests/test_vllm.py::test_latest_policy_is_refused_where_a_token_would_read_same_step_keys_of_its_own_request",
        ),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "v1-backend-without-offsets",
        "the V1 runner loads on FlashInfer, whose metadata has no query_start_loc: the first request ends the engine",
        "recurfit/serving/attention.py",
        (("not runs_model_runner_v2(vllm_config) and backend not in NARROWED_BACKENDS:", "False:"),),
        ("tests/test_vllm.py::test_the_v1_runner_refuses_an_attention_backend_whose_metadata_has_no_request_offsets",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "full-mode-after-the-hook",
        "the worker takes a FULL mode vLLM set after recurfit's hook (fuse_attn_quant): forwards replay at depth 1",
        "recurfit/serving/pieces.py",
        (("    if mode is not None and mode.has_full_cudagraphs():\n", "    if False:\n"),),
        ("tests/test_vllm.py::test_a_full_cuda_graph_mode_vllm_sets_after_the_hook_is_refused_in_the_worker",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "micro-batches-allowed",
        "dual-batch overlap / micro-batching is served: its threads share one forward's depths and step state",
        "recurfit/serving/engine.py",
        (("        _no_micro_batches(vllm_config.parallel_config)\n", ""),),
        ("tests/test_vllm.py::test_dual_batch_overlap_and_micro_batches_are_refused_in_one_line",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "session-changes-depth",
        "a streaming-input session's next chunk runs at another depth, on caches and hashes of its first depth",
        "recurfit/serving/scheduler.py",
        (("            self._same_depth_as_its_session(request, extra_args)\n", ""),),
        ("tests/test_vllm.py::test_a_streaming_session_keeps_its_depth_and_a_chunk_at_another_is_refused",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "draft-pieces-under-the-targets-tag",
        "a draft's compiled pieces are cached under the target's prefix: a draft of another shape loads its kernels",
        "recurfit/serving/pieces.py",
        (('set_model_tag(f"{backends.model_tag}_recurfit_{name}")', 'set_model_tag(f"recurfit_{name}")'),),
        ("tests/test_vllm.py::test_a_drafts_compiled_pieces_are_cached_under_vllms_draft_tag",),
        python=".venv-vllm/bin/python",
    ),
    Mutation(
        "async-scheduler-unsalted",
        "the asynchronous scheduler leaves requests unsalted: a deep request reads a shallow one's blocks",
        "recurfit/serving/scheduler.py",
        (
            (
                "class DepthSaltedAsyncScheduler(DepthSalt, AsyncScheduler):",
                "class DepthSaltedAsyncScheduler(AsyncScheduler):",
            ),
        ),
        ("tests/test_vllm.py::test_the_asynchronous_scheduler_never_gives_a_request_blocks_written_at_another_depth",),
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


OUTCOMES = "RECURFIT_MUTATION_OUTCOMES"  # the file the test process records each test's outcome in


def pytest_runtest_makereport(item, call) -> None:
    """pytest's hook in the test processes this script starts (`-p mutations`): each test's outcome, one JSON line
    [node id, phase, outcome, message]: "passed", "check" (an assert, pytest.raises or pytest.fail failed), or the
    name of the exception that ended it (a crash, a skip, an error in its setup)."""
    record = os.environ.get(OUTCOMES)
    if record is None or (call.excinfo is None and call.when != "call"):
        return
    import pytest

    if call.excinfo is None:
        outcome, message = "passed", ""
    else:
        checked = call.when == "call" and call.excinfo.errisinstance((AssertionError, pytest.fail.Exception))
        outcome = "check" if checked else f"{call.excinfo.typename} in {call.when}"
        message = call.excinfo.exconly().strip().splitlines()[0][:200] if call.excinfo.exconly().strip() else ""
    with open(record, "a") as file:
        file.write(json.dumps([item.nodeid, call.when, outcome, message]) + "\n")


def run_tests(root: Path, mutation: Mutation) -> dict[str, list[tuple[str, str]]]:
    """Each named test's outcomes (`pytest_runtest_makereport`), by the name it was given (a parametrized test's
    cases under its name); a run past the mutation's time limit is stopped, its tests marked "timeout"."""
    record = root / "outcomes.jsonl"
    record.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'scripts'}", OUTCOMES: str(record)}
    python = str(REPO / mutation.python) if mutation.python else sys.executable
    command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutations", *mutation.options]
    process = subprocess.Popen(
        [*command, *mutation.tests], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        process.communicate(timeout=mutation.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the tests' own processes (vLLM servers) with it
        process.communicate()
        timed_out = True
    lines = record.read_text().splitlines() if record.exists() else []
    outcomes: dict[str, list[tuple[str, str]]] = {name: [] for name in mutation.tests}
    for node, _, outcome, message in map(json.loads, lines):
        for name in mutation.tests:
            if node == name or node.startswith(f"{name}["):
                outcomes[name].append((outcome, message))
    if timed_out:
        for name in mutation.tests:
            outcomes[name].append(("timeout", f"past {mutation.timeout} s"))
    return outcomes


def caught_by(outcomes: list[tuple[str, str]]) -> bool:
    return bool(outcomes) and all(outcome == "check" for outcome, _ in outcomes)


def passed(outcomes: list[tuple[str, str]]) -> bool:
    return bool(outcomes) and all(outcome == "passed" for outcome, _ in outcomes)


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
            failing = {name: found for name, found in baseline.items() if not passed(found)}
            if failing:
                raise SystemExit(f"{mutation.name}: its tests do not all pass without the mutation: {failing}")
            original = apply(root, mutation)
            try:
                mutated = run_tests(root, mutation)
            finally:
                (root / mutation.file).write_text(original)
            caught = all(caught_by(found) for found in mutated.values())
            if not caught:
                survived.append(mutation.name)
            print(f"{'caught  ' if caught else 'SURVIVED'} {mutation.name}: {mutation.what}", flush=True)
            for name, found in mutated.items():
                outcome, message = found[0] if found else ("not run", "")
                verdict = "fails its check" if caught_by(found) else f"does not catch it ({outcome})"
                print(f"    {name.split('::')[-1]} {verdict}: {message}", flush=True)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations caught")
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
