"""The loss-scale settings every loss-scale test checks, with values unlike the defaults."""

SETTING_NAMES = (
    "growth_interval",
    "growth_factor",
    "backoff_factor",
    "min_loss_scale",
    "max_loss_scale",
    "hysteresis",
)
# Every setting differs from its default, so a dropped setting shows up.
CUSTOM = dict(
    growth_interval=3,
    growth_factor=3.0,
    backoff_factor=0.25,
    min_loss_scale=0.5,
    max_loss_scale=4096.0,
    hysteresis=2,
)


def settings_of(state):
    return {name: getattr(state, name) for name in SETTING_NAMES}
