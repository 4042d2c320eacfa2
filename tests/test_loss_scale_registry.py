"""Tests for leanstep.blocks.loss_scale_registry: get_loss_scale builds each kind by name and rejects bad specs."""

import re

import pytest

from helpers.loss_scale_settings import CUSTOM, settings_of
from leanstep.blocks.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from leanstep.blocks.loss_scale_registry import get_loss_scale


def test_get_loss_scale_builds_each_kind():
    dynamic = get_loss_scale("dynamic", 64.0, **CUSTOM)
    assert type(dynamic) is DynamicLossScale and settings_of(dynamic) == CUSTOM
    assert float(dynamic.loss_scale) == 64.0
    assert float(get_loss_scale("Dynamic").loss_scale) == 2.0**15
    static = get_loss_scale("static", 8.0)
    assert type(static) is StaticLossScale and float(static.loss_scale) == 8.0
    assert type(get_loss_scale("none")) is NoOpLossScale
    assert get_loss_scale(static) is static


@pytest.mark.parametrize(
    "args, kwargs, error, text",
    [
        (("fp16",), {}, ValueError, "unknown loss scale spec 'fp16'; expected one of 'dynamic', 'static', 'none'"),
        ((3,), {}, TypeError, "spec must be a str or a LossScale, got int 3"),
        (("static",), {}, ValueError, "initial_scale is required for spec 'static', got None"),
        (("static", 2.0), dict(hysteresis=2), ValueError, "settings ['hysteresis'] apply only to spec 'dynamic'"),
        (("none", 4.0), {}, ValueError, "initial_scale must be None or 1 for spec 'none', got 4.0"),
        ((NoOpLossScale(), 2.0), {}, ValueError, "initial_scale and settings apply only to a spec name"),
    ],
)
def test_get_loss_scale_rejects_bad_specs(args, kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        get_loss_scale(*args, **kwargs)
