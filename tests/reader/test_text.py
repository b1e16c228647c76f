"""Token ids decoded with verl's masks, and where two rows first part (trajtrack.reader._text)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trajtrack._exceptions import ConfigurationError
from trajtrack.reader._text import parse_rows, text_differences, text_rows, token_batches
from trajtrack.rollout import RolloutBatch

tokenizers = pytest.importorskip(
    "tokenizers", reason="the text extra: pip install 'trajtrack[text]'"
)

VOCAB = ["[PAD]", "[UNK]", "a", "b", "c", "d", "tool", "out", "end"]


@pytest.fixture(scope="module")
def tok() -> object:
    t = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]")
    )
    t.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return t


def ids(text: str) -> list[int]:
    return [VOCAB.index(w) for w in text.split()]


def test_response_keeps_tool_output_inside_the_mask_span(tok: object) -> None:
    # multi-turn: response_mask is 0 over the tool output, the attention mask is not
    responses = torch.tensor([ids("a tool out b [PAD] [PAD]")])
    response_mask = torch.tensor([[1, 0, 0, 1, 0, 0]])
    batch = {"responses": responses, "response_mask": response_mask}
    (row,) = text_rows(batch, tok)
    assert row.texts == {"responses": "a tool out b"}  # no attention mask: response_mask span
    batch["attention_mask"] = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])  # 2 prompt columns
    batch["prompts"] = torch.tensor([ids("c d")])
    (row,) = text_rows(batch, tok)
    assert row.texts == {"prompts": "c d", "responses": "a tool out b"}


def test_prompt_left_padding_and_uids_from_the_batch(tok: object) -> None:
    prompts = torch.tensor([ids("[PAD] [PAD] a b"), ids("c d a b")])
    responses = torch.tensor([ids("end [PAD]"), ids("c end")])
    attention = torch.cat([prompts != 0, responses != 0], dim=1).long()
    batch = RolloutBatch(
        {"prompts": prompts, "responses": responses, "attention_mask": attention},
        {"uid": np.array(["x", "y"], dtype=object)},
        {},
    )
    rows = text_rows({"step": batch}, tok, rows=[1, 0, 5])
    assert [(r.path, r.row, r.uid, r.texts) for r in rows] == [
        ("['step'].batch", 1, "y", {"prompts": "c d a b", "responses": "c end"}),
        ("['step'].batch", 0, "x", {"prompts": "a b", "responses": "end"}),
    ]


def test_a_shorter_row_differs_at_its_end(tok: object) -> None:
    a = {"responses": torch.tensor([ids("a b c"), ids("a b [PAD]")])}
    b = {"responses": torch.tensor([ids("a b c"), ids("a b c")])}
    a["response_mask"] = (a["responses"] != 0).long()
    b["response_mask"] = (b["responses"] != 0).long()
    (d,) = text_differences(a, b, tok)
    assert (d.row, d.position, d.tokens, d.pieces) == (1, 2, (None, 4), (None, "c"))
    assert d.contexts == (("a b", "", ""), ("a b ", "c", ""))


def test_float_tensors_are_not_token_ids() -> None:
    assert token_batches({"responses": torch.zeros(2, 3)}) == []


@pytest.mark.parametrize(("spec", "rows"), [("3", [3]), ("0-2,1,7", [0, 1, 2, 7])])
def test_parse_rows(spec: str, rows: list[int]) -> None:
    assert parse_rows(spec) == rows


@pytest.mark.parametrize("spec", ["", "a", "1-", "-1", "1-b"])
def test_parse_rows_refuses(spec: str) -> None:
    with pytest.raises(ConfigurationError):
        parse_rows(spec)
