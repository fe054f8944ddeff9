"""Tests of `recurfit/data/chat.py`: conversations rendered with the chat template, and the assistant's tokens."""

from __future__ import annotations

import pytest
from conftest import char_tokenizer, chat_tokenizer, conversations, run_cli, write_conversations

from recurfit.data import prepare
from recurfit.data.chat import ChatRenderer
from recurfit.errors import RecurfitError

SMOLLM2_CONVERSATIONS = [
    [
        {"role": "user", "content": "What is 17 + 25?"},
        {"role": "assistant", "content": "17 + 25 = 42."},
        {"role": "user", "content": "And doubled?"},
        {"role": "assistant", "content": "Doubled, it is 84."},
    ],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "The capital of France?"},
        {"role": "assistant", "content": "Paris"},
    ],
]


def assistant_runs(decode, ids: list[int], mask: list[int]) -> list[str]:
    """The text (`decode(ids)`) of each run of consecutive masked tokens."""
    runs, current = [], []
    for token, marked in zip([*ids, None], [*mask, 0]):
        if marked:
            current.append(token)
        elif current:
            runs.append(decode(current))
            current = []
    return runs


def test_smollm2s_template_renders_apply_chat_templates_tokens_and_masks_each_assistant_reply_and_its_end():
    """The embedded SmolLM2-135M-Instruct: its template has no generation blocks, so the rendered prefixes find the
    assistant's tokens: each reply and the `<|im_end|>` and newline that close its turn, no header, no prompt."""
    from recurfit.model.loading import load_tokenizer

    tokenizer = load_tokenizer(None)
    renderer = ChatRenderer(tokenizer)
    assert renderer.method == "prefixes"
    for messages in SMOLLM2_CONVERSATIONS:
        text, ids, mask = renderer(messages)
        assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert text == tokenizer.apply_chat_template(messages, tokenize=False) and len(mask) == len(ids)
        replies = [m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert assistant_runs(tokenizer.decode, ids, mask) == replies


def test_a_template_with_generation_blocks_and_rendered_prefixes_mark_the_same_tokens():
    spelled = lambda ids: "".join(char_tokenizer().convert_ids_to_tokens(ids))  # noqa: E731 (decode adds spaces)
    marked, plain = ChatRenderer(chat_tokenizer(generation=True)), ChatRenderer(chat_tokenizer(generation=False))
    assert (marked.method, plain.method) == ("generation", "prefixes")
    for messages in conversations(20, seed=3):
        text, ids, mask = marked(messages)
        assert plain(messages) == (text, ids, mask)
        replies = [m["content"] + "</s>\n" for m in messages if m["role"] == "assistant"]
        assert assistant_runs(spelled, ids, mask) == replies


def test_a_template_that_renders_earlier_turns_otherwise_is_refused_naming_the_fix():
    """As templates that drop the reasoning of earlier assistant turns: a turn's prefix is not the whole's."""
    tokenizer = chat_tokenizer(generation=False)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "m['content'] + '</s>\\n'", "(m['content'] if loop.last else m['content'][:2]) + '</s>\\n'"
    )
    two_turns = next(c for c in conversations(20) if sum(m["role"] == "assistant" for m in c) == 2)
    with pytest.raises(RecurfitError, match=r"differently once later turns follow.*\{% generation %\}"):
        ChatRenderer(tokenizer)(two_turns)


def test_messages_without_a_chat_template_are_one_line_naming_the_fix_and_nothing_is_written(
    tmp_path, capsys, workspace
):
    write_conversations(tmp_path / "chat.jsonl", conversations(10))
    with pytest.raises(RecurfitError, match="has no chat template.*tokenizer of an instruct model"):
        prepare(char_tokenizer(), [str(tmp_path / "chat.jsonl")], 16, tmp_path / "store", show_progress=False)
    assert not (tmp_path / "store").exists()
    args = ["--tokenizer", workspace / "parent", "--source", tmp_path / "chat.jsonl", "--out", tmp_path / "store"]
    code, said = run_cli(capsys, "data", "prepare", *args, "--decontaminate", "none")
    assert code == 2 and "has no chat template" in said and said.strip().count("\n") == 0
    assert not (tmp_path / "store").exists() and not list(tmp_path.glob(".store*"))
