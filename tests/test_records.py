"""Tests for leanstep.training.records: the one schema of the trainer's records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.metrics_lines import eval_line, train_line
from leanstep.training.records import EvalRecord, Note, TrainRecord, parse_record

TRAIN_FIELDS = (
    "step",
    "loss",
    "grad_norm",
    "loss_scale",
    "skipped",
    "clipped",
    "consecutive_skips",
    "tokens_per_sec",
    "elapsed_s",
    "lr",
)

floats = st.floats(allow_nan=True, allow_infinity=True)
train_values = st.fixed_dictionaries(
    {
        "step": st.integers(1, 2**40),
        "loss": floats,
        "grad_norm": floats,
        "loss_scale": floats,
        "skipped": st.booleans(),
        "clipped": st.booleans(),
        "consecutive_skips": st.integers(0, 2**31),
        "tokens_per_sec": floats,
        "elapsed_s": floats,
        "lr": floats,
    }
)


def test_fields_and_kinds_are_the_metrics_jsonl_schema():
    assert TrainRecord._fields == (*TRAIN_FIELDS, "spiked")  # 0.9: spiked, last, defaulted when absent
    assert EvalRecord._fields == ("step", "heldout_loss", "heldout_bits_per_byte")
    assert Note._fields == ("message",)
    assert (TrainRecord.kind, EvalRecord.kind, Note.kind) == ("train", "eval", "note")
    assert "kind" not in TrainRecord._fields  # a class attribute, not a field


@settings(max_examples=200, deadline=None)
@given(train_values)
def test_train_line_is_the_old_dict_line_and_round_trips(values):
    # The trainer wrote ``json.dumps({"kind": "train", "step": ..., ...})``, keys in this order;
    # 0.9 adds "spiked" at the end, and reads a line without it as not spiked.
    old_line = json.dumps({"kind": "train", **{field: values[field] for field in TRAIN_FIELDS}})
    record = TrainRecord(**values)
    line = json.dumps(record.to_json())
    assert line == old_line[:-1] + ', "spiked": false}'
    assert parse_record(json.loads(old_line)) == record or any(
        isinstance(v, float) and math.isnan(v) for v in values.values()
    )
    parsed = parse_record(json.loads(line))
    assert type(parsed) is TrainRecord
    assert json.dumps(parsed.to_json()) == line  # NaN != NaN, so compare the lines
    if not any(isinstance(v, float) and math.isnan(v) for v in values.values()):
        assert parsed == record


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**40), floats)
def test_eval_line_is_the_old_dict_line_and_round_trips(step, loss):
    old_line = json.dumps(
        {"kind": "eval", "step": step, "heldout_loss": loss, "heldout_bits_per_byte": loss / math.log(2)}
    )
    record = EvalRecord.from_loss(step, loss)
    assert json.dumps(record.to_json()) == old_line
    parsed = parse_record(json.loads(old_line))
    assert type(parsed) is EvalRecord and json.dumps(parsed.to_json()) == old_line


def test_numpy_scalars_are_written_as_the_trainer_wrote_them():
    # After jax.device_get the step metrics are NumPy scalars; the trainer applied float/int/bool.
    loss, grad, scale = np.float32(2.7182817), np.float32(np.inf), np.float32(1024.0)
    record = TrainRecord(
        np.int64(7), loss, grad, scale, np.bool_(True), np.bool_(False), np.int32(3), 1234.5, 9.25, np.float32(3e-4)
    )
    old = {
        "kind": "train",
        "step": 7,
        "loss": float(loss),
        "grad_norm": float(grad),
        "loss_scale": float(scale),
        "skipped": True,
        "clipped": False,
        "consecutive_skips": 3,
        "tokens_per_sec": 1234.5,
        "elapsed_s": 9.25,
        "lr": float(np.float32(3e-4)),
        "spiked": False,
    }
    out = record.to_json()
    assert json.dumps(out) == json.dumps(old)
    assert [type(v) for v in out.values()] == [
        str,
        int,
        float,
        float,
        float,
        bool,
        bool,
        int,
        float,
        float,
        float,
        bool,
    ]
    assert json.dumps(EvalRecord.from_loss(np.int32(4), np.float32(1.5)).to_json()) == json.dumps(eval_line(4, 1.5))


def test_from_loss_is_bits_per_byte_over_ln2():
    record = EvalRecord.from_loss(10, 3.0)
    assert record == EvalRecord(10, 3.0, 3.0 / math.log(2))
    assert math.isclose(2**record.heldout_bits_per_byte, math.exp(3.0), rel_tol=1e-12)
    assert math.isnan(EvalRecord.from_loss(1, math.nan).heldout_bits_per_byte)


def test_parse_coerces_like_the_reader():
    line = train_line(3, loss=2, skipped=1, clipped=0, lr=None)
    record = parse_record(line)
    assert record.loss == 2.0 and type(record.loss) is float
    assert record.skipped is True and record.clipped is False and math.isnan(record.lr)


def test_other_kinds_are_for_other_readers():
    assert parse_record({"kind": "note", "message": "hi"}) is None
    assert parse_record({"kind": "checkpoint", "step": 4}) is None


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([1, 2], r"^line 9 is \[1, 2\]; expected a JSON object$"),
        ({"step": 1}, r"^line 9 has no 'kind' field; expected 'train' or 'eval'$"),
        ({k: v for k, v in train_line(2).items() if k != "lr"}, r"^line 9 \('train' record\) lacks the field 'lr'$"),
        ({**train_line(2), "step": 2.5}, r"^line 9 field 'step' is 2.5; expected int$"),
        ({**train_line(2), "step": True}, r"^line 9 field 'step' is True; expected int$"),
        (train_line(2, loss="low"), r"^line 9 field 'loss' is 'low'; expected float$"),
        (train_line(2, loss=False), r"^line 9 field 'loss' is False; expected float$"),
        (train_line(2, skipped="yes"), r"^line 9 field 'skipped' is 'yes'; expected bool$"),
        ({**eval_line(2, 1.0), "heldout_loss": [1.0]}, r"^line 9 field 'heldout_loss' is \[1.0\]; expected float$"),
    ],
)
def test_parse_errors_name_the_line_field_and_expected_type(obj, message):
    with pytest.raises(ValueError, match=message):
        parse_record(obj, "line 9")
