"""GuardConfig: one frozen value from code, the environment (KVGUARD_*) or CLI flags; every
invalid setting is a ConfigError (a ValueError) at start-up, never mid-serving."""

from __future__ import annotations

import dataclasses

import pytest

from kvguard.config import ConfigError, GuardConfig, Mode, OnViolation


def test_defaults():
    c = GuardConfig()
    assert (c.mode, c.sweep_tokens_per_step, c.tenant_isolation) == (Mode.VERIFIED, 512, False)
    assert c.enabled and c.checksums and c.verifies_reads


@pytest.mark.parametrize(
    "mode, enabled, checksums",
    [
        ("off", False, False),
        ("tags", True, False),
        ("sampled", True, True),
        ("verified", True, True),
        ("paranoid", True, True),
    ],
)
def test_mode_properties(mode, enabled, checksums):
    c = GuardConfig(mode=mode)
    assert c.mode is Mode(mode)
    assert (c.enabled, c.checksums) == (enabled, checksums)


def test_mode_from_string_is_case_insensitive():
    assert GuardConfig(mode="PARANOID").mode is Mode.PARANOID
    assert GuardConfig(mode=Mode.TAGS).mode is Mode.TAGS


def test_invalid_mode_names_the_choices():
    with pytest.raises(ConfigError, match="invalid kvguard mode 'bogus'") as err:
        GuardConfig(mode="bogus")
    assert all(m.value in str(err.value) for m in Mode)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True, None])
def test_invalid_sweep_budget(bad):
    with pytest.raises(ConfigError, match="sweep_tokens_per_step must be an integer >= 0"):
        GuardConfig(sweep_tokens_per_step=bad)


def test_zero_sweep_budget_is_allowed():
    assert GuardConfig(sweep_tokens_per_step=0).sweep_tokens_per_step == 0


def test_frozen_and_with_():
    c = GuardConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.mode = Mode.OFF  # type: ignore[misc]
    d = c.with_(mode="tags")
    assert d.mode is Mode.TAGS and c.mode is Mode.VERIFIED
    with pytest.raises(ConfigError):
        c.with_(sweep_tokens_per_step=-3)


def test_from_env_mapping():
    env = {
        "KVGUARD_MODE": "tags",
        "KVGUARD_SWEEP_TOKENS_PER_STEP": "7",
        "KVGUARD_TENANT_ISOLATION": "yes",
        "KVGUARD_UNRELATED": "ignored",
    }
    assert GuardConfig.from_env(env) == GuardConfig("tags", 7, True)
    assert GuardConfig.from_env({}) == GuardConfig()


@pytest.mark.parametrize(
    "raw, value",
    [
        ("1", True),
        ("true", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("no", False),
        (" off ", False),
    ],
)
def test_boolean_spellings(raw, value):
    assert GuardConfig.from_env({"KVGUARD_TENANT_ISOLATION": raw}).tenant_isolation is value


@pytest.mark.parametrize(
    "env, fragment",
    [
        (
            {"KVGUARD_TENANT_ISOLATION": "maybe"},
            "KVGUARD_TENANT_ISOLATION='maybe' is not a boolean",
        ),
        (
            {"KVGUARD_SWEEP_TOKENS_PER_STEP": "lots"},
            "KVGUARD_SWEEP_TOKENS_PER_STEP='lots' is not an integer",
        ),
        ({"KVGUARD_SWEEP_TOKENS_PER_STEP": "-5"}, "sweep_tokens_per_step must be"),
        ({"KVGUARD_MODE": "strict"}, "invalid kvguard mode"),
    ],
)
def test_from_env_errors_name_the_variable(env, fragment):
    with pytest.raises(ConfigError) as err:
        GuardConfig.from_env(env)
    assert fragment in str(err.value)


def test_overrides_win_and_none_is_no_override():
    env = {"KVGUARD_MODE": "tags", "KVGUARD_SWEEP_TOKENS_PER_STEP": "7"}
    c = GuardConfig.from_env(env, mode="paranoid", sweep_tokens_per_step=None)
    assert (c.mode, c.sweep_tokens_per_step) == (Mode.PARANOID, 7)


def test_from_env_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("KVGUARD_MODE", "off")
    monkeypatch.setenv("KVGUARD_SWEEP_TOKENS_PER_STEP", "64")
    monkeypatch.delenv("KVGUARD_TENANT_ISOLATION", raising=False)
    assert GuardConfig.from_env() == GuardConfig("off", 64, False)


@pytest.mark.parametrize(
    "config",
    [GuardConfig(), GuardConfig("off"), GuardConfig("paranoid", 0, True), GuardConfig("tags", 3)],
)
def test_to_env_round_trips(config):
    env = config.to_env()
    assert all(k.startswith("KVGUARD_") and isinstance(v, str) for k, v in env.items())
    assert GuardConfig.from_env(env) == config


def test_to_env_spelling():
    assert GuardConfig("paranoid", 9, True, 0.05).to_env() == {
        "KVGUARD_MODE": "paranoid",
        "KVGUARD_SWEEP_TOKENS_PER_STEP": "9",
        "KVGUARD_TENANT_ISOLATION": "1",
        "KVGUARD_QUARANTINE_CAP": "0.05",
        "KVGUARD_ON_VIOLATION": "recompute",
        "KVGUARD_RECOMPUTE_BUDGET": "2",
        "KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE": "60",
    }


def test_on_violation_from_env_and_defaults():
    assert GuardConfig().on_violation is OnViolation.RECOMPUTE
    c = GuardConfig.from_env({"KVGUARD_ON_VIOLATION": "ABORT", "KVGUARD_RECOMPUTE_BUDGET": "5"})
    assert c.on_violation is OnViolation.ABORT and c.recompute_budget == 5
    assert GuardConfig.from_env(c.to_env()) == c


@pytest.mark.parametrize(
    "env",
    [
        {"KVGUARD_ON_VIOLATION": "retry"},
        {"KVGUARD_RECOMPUTE_BUDGET": "-1"},
        {"KVGUARD_RECOMPUTE_BUDGET": "two"},
        {"KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE": "1.5"},
    ],
)
def test_bad_healing_settings_are_refused(env):
    with pytest.raises(ConfigError, match=r"on_violation|RECOMPUTE|recompute"):
        GuardConfig.from_env(env)


@pytest.mark.parametrize("raw", ["0", "1.5", "-0.1", "lots"])
def test_quarantine_cap_is_a_fraction_of_the_pool(raw):
    with pytest.raises(ConfigError, match=r"QUARANTINE_CAP|quarantine_cap"):
        GuardConfig.from_env({"KVGUARD_QUARANTINE_CAP": raw})


def test_quarantine_cap_in_pages():
    assert GuardConfig(quarantine_cap=0.01).quarantine_cap_pages(62_500) == 625
    assert GuardConfig(quarantine_cap=0.01).quarantine_cap_pages(10) == 1
    # a small pool keeps a floor: one incident does not fail it closed
    assert GuardConfig(quarantine_cap=0.01).quarantine_cap_pages(128) == 16
    assert GuardConfig(quarantine_cap=0.5).quarantine_cap_pages(128) == 64
