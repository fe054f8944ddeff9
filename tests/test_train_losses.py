"""Tests of `recurfit/train/losses.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DISTILL, chat_tokenizer, config_for, conversations, tiny_config, tiny_parent, write_conversations
from safetensors.torch import load_file

from recurfit.errors import RecurfitError
from recurfit.model.accounting import training_flops_per_token
from recurfit.model.sampling import mixed_seed
from recurfit.train import Trainer, head, losses, train
from recurfit.train.config import DistillConfig, SuperviseConfig
from recurfit.train.losses import depth_weights, supervised_steps
from recurfit.train.metrics import read_log


def micro_batch(trainer: Trainer, rows: int = 2) -> torch.Tensor:
    """Rows on the trainer's device (the GPU under the GPU check's --device cuda)."""
    return trainer.stream.next_batch(rows, 0, 1).to(trainer.processes.device)


def hand_loss(student, teacher, targets, alpha: float | None, temperature: float) -> tuple:
    """(loss, ce, kl) written out: log-softmax by hand, KL(teacher_T ‖ student_T) = Σ p_t (log p_t - log p_s)."""
    log_softmax = lambda x: x - x.exp().sum(-1, keepdim=True).log()  # noqa: E731
    ce = -log_softmax(student.double()).gather(-1, targets.unsqueeze(-1)).mean()
    if alpha is None:
        return ce, ce, None
    log_s, log_t = log_softmax(student.double() / temperature), log_softmax(teacher.double() / temperature)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1).mean()
    return alpha * ce + (1 - alpha) * temperature**2 * kl, ce, kl


def reference_logits(trainer: Trainer, inputs: torch.Tensor, first_row: int, num_steps) -> torch.Tensor:
    """The student's logits from its own forward, with the s_0 the loop draws for this micro-batch."""
    torch.manual_seed(mixed_seed(trainer.config.seed, first_row))
    return trainer.model(input_ids=inputs, num_steps=num_steps).logits


def config_for_supervise(last):
    from recurfit.train.config import SuperviseConfig

    return SuperviseConfig(last=last)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 positions of the 97-token vocabulary: a (3, 7) batch spans five chunks, the last partial."""
    monkeypatch.setattr(head, "CHUNK_ELEMENTS", 97 * 5)


def hidden_weight_and_targets(seed: int = 0):
    """Final hidden states (3 rows of 7 positions, 16 wide), a head of a 97-token vocabulary, targets."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 16, generator=generator).requires_grad_()
    weight = (0.5 * torch.randn(97, 16, generator=generator)).requires_grad_()
    return hidden, weight, torch.randint(0, 97, (3, 7), generator=generator)


def gradients(loss: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, tensors, retain_graph=True)


def test_distillation_loss_equals_a_hand_computation(tmp_path, workspace):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(config_for(workspace, tmp_path / "run", "distill.alpha=0.3", "precision=fp32", *DISTILL))
    rows = micro_batch(trainer)
    terms = {}
    loss = trainer._micro_batch_loss(rows, (1, 2), 5, terms)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    teacher = AutoModelForCausalLM.from_pretrained(workspace / "parent").to(rows.device).eval()
    with torch.no_grad():
        expected = hand_loss(
            reference_logits(trainer, inputs, 5, (1, 2)), teacher(input_ids=inputs).logits, targets, 0.3, 1.7
        )
    for got, want in zip((loss, terms["ce"], terms["kl"]), expected, strict=True):
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert expected[2] > 0.01  # the pruned student is far from its parent: the KL term matters
    # validation reads plain CE: 1 + 2 recurrences from the same s_0
    assert trainer._validation_losses(rows, [3], 5)[0].item() == pytest.approx(expected[1].item(), rel=1e-5)
    trainer.close()


def test_alpha_1_reproduces_the_plain_run_and_the_teacher_is_counted_not_saved(tmp_path, workspace):
    drawn = "model.adapter_init=torch-default"  # the student differs from its parent from the first step
    plain = train(config_for(workspace, tmp_path / "plain", "steps=4", drawn))
    distilled = train(config_for(workspace, tmp_path / "distilled", "steps=4", drawn, "distill.alpha=1"))
    assert distilled.losses == plain.losses  # bit for bit: the KL enters with weight 0
    records = [r for r in read_log(tmp_path / "distilled") if r["kind"] == "train"]
    assert [r["ce"] for r in records] == plain.losses and all(r["kl"] > 0 for r in records)
    # The teacher's forward: 2 · its non-embedding parameters (6 layers + final norm) per token, 8 rows of 32.
    parent = tiny_parent("llama", place=False)
    body = sum(p.numel() for p in parent.model.layers.parameters()) + parent.model.norm.weight.numel()
    assert [r["flops_teacher"] for r in records] == [step * 8 * 32 * 2 * body for step in range(1, 5)]
    start = read_log(tmp_path / "distilled")[0]
    assert start["distill"]["alpha"] == 1 and start["distill"]["teacher"] == str(workspace / "parent")
    for name in ("checkpoints/step-000004", "final"):
        a, b = (load_file(tmp_path / run / name / "model.safetensors") for run in ("plain", "distilled"))
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)  # no teacher tensor
        assert {p.name for p in (tmp_path / "plain" / name).iterdir()} == {
            p.name for p in (tmp_path / "distilled" / name).iterdir()
        }


def test_supervised_depths_and_weights():
    assert supervised_steps((5, 3), None) == [8]
    assert supervised_steps((5, 3), config_for_supervise(None)) == [6, 7, 8]
    assert supervised_steps((5, 3), config_for_supervise(2)) == [7, 8]
    assert supervised_steps((0, 1), config_for_supervise(4)) == [1]  # at most the k with gradient
    assert depth_weights(3, "uniform") == pytest.approx([1 / 3] * 3)
    assert depth_weights(3, "linear") == pytest.approx([1 / 6, 2 / 6, 3 / 6])


@pytest.mark.parametrize("distill", [None, 0.6], ids=["ce", "with-distillation"])
def test_depth_supervision_equals_the_weighted_mean_of_separate_forwards(tmp_path, workspace, distill):
    """One forward of (2, 3) read out at recurrences 3, 4, 5 against three forwards of (2, 1), (2, 2), (2, 3)
    from the same s_0: equal losses, and equal gradients (the core's from every depth)."""
    from transformers import AutoModelForCausalLM

    # A drawn adapter: with the identity one every recurrence reads e alone, and all depths would agree.
    settings = ["depth.supervise.last=3", "depth.supervise.weighting=linear", "model.adapter_init=torch-default"]
    settings += [f"distill.alpha={distill}", "distill.temperature=1.7"] if distill else []
    trainer = Trainer(config_for(workspace, tmp_path / "run", "precision=fp32", *settings))
    model, rows = trainer.model, micro_batch(trainer)
    inputs, targets = rows[:, :-1], rows[:, 1:]
    terms = {}
    supervised = trainer._micro_batch_loss(rows, (2, 3), 7, terms)
    supervised.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    with torch.no_grad():
        teacher = AutoModelForCausalLM.from_pretrained(workspace / "parent").to(rows.device).eval()
        teacher = teacher(input_ids=inputs).logits
    weights = [1 / 6, 2 / 6, 3 / 6]
    losses, ces = [], []
    for weight, k in zip(weights, (1, 2, 3)):
        logits = reference_logits(trainer, inputs, 7, (2, k))
        loss, ce, _ = hand_loss(logits, teacher, targets, distill, 1.7)
        (weight * loss).backward()  # accumulates Σ w_d ∇loss_d
        losses.append(loss.item())
        ces.append(ce.item())
    assert supervised.item() == pytest.approx(sum(w * loss for w, loss in zip(weights, losses)), rel=1e-5)
    assert terms["ce"].item() == pytest.approx(ces[-1], rel=1e-5)
    assert terms["ce_supervised"].item() == pytest.approx(sum(w * c for w, c in zip(weights, ces)), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    # Each depth's own gradient reaches the core: the shallow readouts add to the final one's.
    model.zero_grad()
    hand_loss(reference_logits(trainer, inputs, 7, (2, 3)), teacher, targets, distill, 1.7)[0].backward()
    core = [n for n, _ in model.named_parameters() if ".core." in n]
    assert all(not torch.allclose(got[n], dict(model.named_parameters())[n].grad) for n in core)
    trainer.close()


def test_supervised_runs_log_both_losses_and_count_the_readouts(tmp_path, workspace):
    trainer = Trainer(config_for(workspace, tmp_path / "run", "steps=3", "depth.supervise={}"))
    trainer.run()
    records = [r for r in read_log(tmp_path / "run") if r["kind"] == "train"]
    counts = trainer.parameter_counts
    per_token = [
        training_flops_per_token(counts, (r["n"], r["k"])) + 6 * (r["k"] - 1) * (counts["coda"] + counts["final_norm"])
        for r in records
    ]
    assert records[-1]["flops"] == sum(8 * 32 * f for f in per_token)
    assert all({"ce", "ce_supervised"} <= r.keys() and "kl" not in r for r in records)
    assert any(r["k"] > 1 and r["ce"] != r["ce_supervised"] for r in records)


def test_a_baseline_distils_too_and_starts_at_its_teacher(tmp_path, workspace):
    """The non-recurrent parent trained as it is, distilled from itself: KL 0 before the first update."""
    train(config_for(workspace, tmp_path / "run", "steps=2", "model.shape=null", "distill.alpha=0.5"))
    first, second = (r for r in read_log(tmp_path / "run") if r["kind"] == "train")
    assert first["kl"] == 0 and first["loss"] == pytest.approx(0.5 * first["ce"]) and second["kl"] > 0


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_the_head_loss_equals_the_plain_one_value_and_gradients(small_chunks):
    """HeadLoss against lm_head then cross_entropy on the whole logits, float32: the loss and the gradients of the
    hidden states and of the head's weight (summed over five chunks)."""
    hidden, weight, targets = hidden_weight_and_targets()
    chunked, _ = head.head_losses(hidden.flatten(0, 1), weight, targets)
    plain = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(gradients(2.5 * chunked, hidden, weight), gradients(2.5 * plain, hidden, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_the_head_loss_under_autocast_multiplies_in_bf16_as_lm_head(small_chunks):
    """Under bf16 autocast the chunks' logits are lm_head's bf16 logits (the same loss), and the gradients are
    autocast's: the hidden states' equal, the weight's summed in float32 over the chunks where autocast sums in one bf16
    matmul (so they differ by bf16 rounding: at most 2⁻⁸ of the gradient's norm). Measured on an AMD EPYC with
    AVX512-BF16 (no AMX), natively and under ONEDNN_MAX_CPU_ISA=AVX512_CORE and =AVX2: the weight's gradients 2.23e-3
    apart (1.75x below 2⁻⁸), the losses equal."""
    hidden, weight, targets = hidden_weight_and_targets()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked, _ = head.head_losses(hidden.flatten(0, 1), weight, targets)
        logits = F.linear(hidden, weight)
    assert logits.dtype == torch.bfloat16 and chunked.dtype == torch.float32
    plain = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    (got_hidden, got_weight), (want_hidden, want_weight) = (
        gradients(loss, hidden, weight) for loss in (chunked, plain)
    )
    assert got_hidden.dtype == got_weight.dtype == torch.float32
    torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=0)
    assert (got_weight - want_weight).norm() <= 2**-8 * want_weight.norm()


@pytest.mark.cpu_only("not one of the tests that --device/--dtype move (it runs on the CPU in float32 only)")
def test_distillation_and_supervision_equal_the_plain_losses(small_chunks):
    """Every supervised depth is distilled from the teacher's head read chunk by chunk: the same objective as
    log_softmax and kl_div on the whole vocabulary, value and gradient (each depth's hidden states, the head)."""
    depths = [hidden_weight_and_targets(seed)[0] for seed in (1, 2)]
    _, weight, targets = hidden_weight_and_targets()
    teacher_hidden, teacher_weight, _ = hidden_weight_and_targets(3)
    alpha, temperature = 0.3, 2.0
    healing = losses.HealingLoss(DistillConfig(alpha=alpha, temperature=temperature), SuperviseConfig())
    teacher = (teacher_hidden.flatten(0, 1), teacher_weight)
    chunked = healing([depth.flatten(0, 1) for depth in depths], weight, targets, teacher, {})

    def plain(student):
        student_log = F.log_softmax(F.linear(student, weight).flatten(0, 1) / temperature, dim=-1)
        teacher_log = F.log_softmax(F.linear(teacher_hidden, teacher_weight).flatten(0, 1) / temperature, dim=-1)
        kl = F.kl_div(student_log, teacher_log, reduction="batchmean", log_target=True)
        ce = F.cross_entropy(F.linear(student, weight).flatten(0, 1), targets.flatten())
        return alpha * ce + (1 - alpha) * temperature**2 * kl

    reference = sum(plain(student) / 2 for student in depths)
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=1e-6)
    for got, want in zip(gradients(chunked, *depths, weight), gradients(reference, *depths, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert teacher_weight.grad is None and teacher_hidden.grad is None  # the teacher is not trained


def test_the_head_loss_with_a_mask_is_the_mean_over_the_masked_positions_value_and_gradients(small_chunks):
    """CE against cross_entropy with the unmasked targets ignored (-100), KL against its formula averaged over the
    masked positions, both with their gradients, over five chunks; no masked position: 0 and no gradient."""
    hidden, weight, targets = hidden_weight_and_targets()
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 7, generator=generator) < 0.4
    teacher = torch.randn(21, 16, generator=generator), torch.randn(97, 16, generator=generator)
    ce, kl = head.head_losses(hidden.flatten(0, 1), weight, targets, teacher, 2.0, mask.flatten())
    logits = F.linear(hidden, weight).flatten(0, 1)
    plain = F.cross_entropy(logits, targets.masked_fill(~mask, -100).flatten())
    log_s, log_t = F.log_softmax(logits / 2.0, -1), F.log_softmax(F.linear(*teacher) / 2.0, -1)
    hand_kl = (log_t.exp() * (log_t - log_s)).sum(-1)[mask.flatten()].mean()
    for got, want in ((ce, plain), (kl, hand_kl)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for got_grad, want_grad in zip(gradients(2.5 * got, hidden, weight), gradients(2.5 * want, hidden, weight)):
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-7)
    assert (gradients(ce, hidden)[0][~mask] == 0).all() and mask.sum() < 21 / 2  # the others get no gradient
    none, _ = head.head_losses(hidden.flatten(0, 1), weight, targets, mask=torch.zeros(21, dtype=torch.bool))
    assert none.item() == 0 and not gradients(none, weight)[0].any()


def chat_store(tmp_path):
    """A store of conversations in the workspace parent's tokenizer (its vocabulary, with a chat template)."""
    from recurfit.data import prepare

    write_conversations(tmp_path / "chat.jsonl", conversations(200, seed=5))
    settings = dict(val_fraction=0, show_progress=False, decontaminate="none")
    prepare(chat_tokenizer(), [str(tmp_path / "chat.jsonl")], 32, tmp_path / "chat", **settings)
    return tmp_path / "chat"


def chat_config(workspace, tmp_path, store, masked: bool):
    from recurfit.train import load_config

    config = tiny_config(workspace, tmp_path / f"run-{masked}", batch={"micro": 2, "global": 4})
    config["data"] = {"phases": [{"sources": [str(store)]}], "validation": [], "assistant_only_loss": masked}
    return load_config(None, [], base=config)


def test_assistant_only_loss_is_the_mean_over_the_assistants_targets_of_the_global_batch(tmp_path, workspace):
    """The step's loss against cross-entropy computed by hand from the model's own logits, over the targets the
    masks mark in both micro-batches (which hold different counts of them: a mean of the micro-batches' means
    would differ). Off, the same store trains on every target. Tolerance: float32 logits against float64 CE, as
    the distillation test (rel 1e-5, 4.7e-5 here). Negative controls, measured: the loss over every target is
    0.057 away and the micro-batches' means averaged 0.0055 away, each over 100 times the tolerance."""
    from recurfit.data import Phase, RowStream

    store = chat_store(tmp_path)
    losses = {}
    for masked in (True, False):
        trainer = Trainer(chat_config(workspace, tmp_path, store, masked))
        plan = trainer._plan(0)
        losses[masked], _ = trainer._forward_backward(plan)
    rows, masks = RowStream([Phase({str(store): 1.0})], seed=trainer.config.seed, masks=True).next_rows(4)
    rows, targets_mask = rows.to(trainer.processes.device), masks[:, 1:].to(trainer.processes.device)
    with torch.no_grad():
        ce = torch.cat([
            F.cross_entropy(
                reference_logits(trainer, rows[first : first + 2, :-1], first, plan.at_row(first).num_steps)
                .double().flatten(0, 1),
                rows[first : first + 2, 1:].flatten(),
                reduction="none",
            ).view(2, -1)
            for first in (0, 2)
        ])  # fmt: skip
    assert targets_mask[:2].sum() != targets_mask[2:].sum() and 0 < targets_mask.sum() < targets_mask.numel() / 2
    expected = ce[targets_mask].mean().item()
    assert losses[True] == pytest.approx(expected, rel=1e-5)
    assert losses[False] == pytest.approx(ce.mean().item(), rel=1e-5)
    means = [ce[part][targets_mask[part]].mean().item() for part in (slice(0, 2), slice(2, 4))]
    for wrong in (losses[False], sum(means) / 2):  # every target; the micro-batches' means averaged
        assert abs(wrong - expected) > 100 * 1e-5 * expected


def test_assistant_only_loss_on_a_store_of_plain_text_is_refused_in_one_line_naming_the_fix(tmp_path, workspace):
    with pytest.raises(RecurfitError) as refused:
        Trainer(config_for(workspace, tmp_path / "run", "data.assistant_only_loss=true"))
    said = str(refused.value)
    assert "\n" not in said and not (tmp_path / "run").exists()
    assert "data.assistant_only_loss is on, but" in said and "holds no assistant masks" in said
    assert "prepare it from conversations (a `messages` field), or set data.assistant_only_loss=false" in said
