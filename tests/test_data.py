"""Packing: short documents stay whole, long ones are cut into row-long pieces, nothing is lost."""

import numpy as np

from sbd_jax.data.packing import Document, pack, padding_fraction


def docs(lengths):
    out, next_id = [], 1
    for n in lengths:
        out.append(Document(list(range(next_id, next_id + n)), [i % 2 == 0 for i in range(n)]))
        next_id += n
    return out


def pieces(packed):
    """(tokens, loss mask, positions) of every run of one segment id, row by row."""
    found = []
    for row in range(len(packed.tokens)):
        seg = packed.segment_ids[row]
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            assert (np.diff(where) == 1).all()  # a segment is one contiguous run
            found.append((packed.tokens[row, where].tolist(), packed.loss_mask[row, where].tolist(),
                          packed.positions[row, where].tolist()))
    return found


def test_documents_that_fit_are_never_split_and_every_token_is_packed_once():
    rng = np.random.RandomState(0)
    documents = docs(rng.randint(1, 17, 300).tolist() + [40, 16])  # 40 > 16: cut into 16 + 16 + 8
    packed = pack(documents, 16)
    found = pieces(packed)
    whole = {tuple(d.ids): d for d in documents if len(d.ids) <= 16}
    for tokens, loss, positions in found:
        assert positions == list(range(len(tokens)))
        if tuple(tokens) in whole:
            assert loss == whole[tuple(tokens)].loss_mask
    assert set(whole) <= {tuple(t) for t, _, _ in found}
    long_doc = documents[-2].ids
    assert sorted(t for t, _, _ in found if t[0] in long_doc) == [long_doc[:16], long_doc[16:32], long_doc[32:]]
    assert sorted(t for tokens, _, _ in found for t in tokens) == sorted(t for d in documents for t in d.ids)
    # Best fit wastes little even with documents up to a whole row long (here 4.5%).
    total = sum(len(d.ids) for d in documents)
    assert len(packed.tokens) <= 1.1 * -(-total // 16)
    assert np.isclose(padding_fraction(packed), 1 - total / packed.tokens.size) and padding_fraction(packed) < 0.1


def test_a_document_that_does_not_fit_the_rest_of_a_row_opens_another():
    packed = pack(docs([10, 10, 6]), 16)
    assert packed.segment_ids.tolist() == [[1] * 10 + [2] * 6, [1] * 10 + [0] * 6]


def char_tokenizer(tmp_path):
    from sbd_jax.checkpoints.tokenizer import load_tokenizer
    from sbd_jax.evaluation.char_tokenizer import save_char_tokenizer

    return load_tokenizer(save_char_tokenizer(str(tmp_path / "tok")))


def test_prompt_completion_records_carry_loss_on_the_completion_and_its_eos_only(tmp_path):
    import json

    from sbd_jax.checkpoints.tokenizer import encode_prompt
    from sbd_jax.data.packing import read_records, tokenize

    tok = char_tokenizer(tmp_path)
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "a1+b2=", "completion": "x9"}) + "\n")
    (record,) = read_records(str(path))
    doc = tokenize(record, tok)
    prompt_ids = encode_prompt(tok, "a1+b2=", chat=False)  # what decoding feeds the model
    assert doc.ids == prompt_ids + tok("x9", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert doc.loss_mask == [False] * len(prompt_ids) + [True] * 3


def test_a_record_with_an_empty_completion_is_refused_with_the_accepted_formats(tmp_path):
    import json

    import pytest

    from sbd_jax.data.packing import read_records
    from sbd_jax.errors import UserError

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a1+b2=", "completion": ""}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:1: .*\"prompt\": \"...\", \"completion\": \"...\"\} \(both non-empty\)"):
        list(read_records(str(path)))


def test_chat_loss_covers_assistant_turns_up_to_their_eos_not_the_template_after_it(tmp_path):
    from sbd_jax.data.packing import tokenize

    tok = char_tokenizer(tmp_path)
    # ChatML's shape: each turn ends in EOS and then a newline the model never generates.
    tok.chat_template = "{% for m in messages %}{{ m['role'][0] }}={{ m['content'] }}" + tok.eos_token + "\n{% endfor %}"
    doc = tokenize({"messages": [{"role": "user", "content": "a1"}, {"role": "assistant", "content": "b2"},
                                 {"role": "user", "content": "c3"}, {"role": "assistant", "content": "d4"}]}, tok)
    turn = len(tok.apply_chat_template([{"role": "user", "content": "a1"}], tokenize=True, return_dict=False))
    assert turn == 6 and doc.ids[turn - 2] == tok.eos_token_id  # 'u=a1', EOS, newline
    # No loss on user turns; an assistant turn's 'a=b2' and EOS carry loss, its newline does not.
    assert doc.loss_mask == ([False] * 6 + [True] * 5 + [False]) * 2


def test_a_record_with_both_text_and_messages_is_refused_naming_its_line():
    import pytest

    from sbd_jax.data.packing import checked_record
    from sbd_jax.errors import UserError

    record = {"text": "a", "messages": [{"role": "user", "content": "b"}]}
    with pytest.raises(UserError, match=r"f.jsonl:3: the record has both text and messages: keep one of them"):
        checked_record(record, "f.jsonl:3")
