"""``peer join`` settings: precedence of flags, TOML, environment and defaults; clear errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dht.errors import ConfigError
from peer.run.config import PeerConfig
from peer.run.flags import add_config_arguments, join_command, load_config

pytestmark = pytest.mark.timeout(30)


def parse(*argv: str) -> PeerConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return load_config(parser.parse_args(argv))


def test_defaults_and_help_document_every_field():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    text = parser.format_help()
    for name in PeerConfig.model_fields:
        assert "--" + name.replace("_", "-") in text
    assert "(default: 2048)" in text
    assert parse() == PeerConfig()


def test_precedence_flags_over_toml_over_env(tmp_path, monkeypatch):
    toml = tmp_path / "peer.toml"
    toml.write_text('target_batch_size = 512\nlr = 0.5\ninitial-peers = ["http://1.2.3.4:5"]\n')
    monkeypatch.setenv("VP_TARGET_BATCH_SIZE", "64")
    monkeypatch.setenv("VP_LR", "0.25")
    monkeypatch.setenv("VP_SEED", "7")
    config = parse(
        "--config",
        str(toml),
        "--lr",
        "0.125",
        "--task-option",
        "hidden=8",
        "--task-option",
        "depth=2",
        "--client-mode",
    )
    assert config.lr == 0.125  # flag
    assert config.target_batch_size == 512  # TOML over environment
    assert config.seed == 7  # environment over default
    assert config.initial_peers == ["http://1.2.3.4:5"]
    assert config.task_options() == {"hidden": "8", "depth": "2"}
    assert config.client_mode and config.transport_config().client_mode
    assert config.progress_config().target_batch_size == 512


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target-batch-size", "0"], "--target-batch-size"),
        (["--lr", "-1"], "--lr"),
        (["--initial-peers", "nohost"], "--initial-peers"),
        (["--task-option", "novalue"], "--task-option"),
        (["--port", "99999"], "--port"),
        (["--min-deadline", "0"], "--min-deadline"),
        (["--min-deadline", "61"], "--min-deadline"),
        (["--max-digest-stride", "3"], "--max-digest-stride: must be a power of two"),
        (["--max-digest-stride", "128"], "--max-digest-stride"),
        (["--max-digest-gap", "0"], "--max-digest-gap"),
    ],
)
def test_invalid_values_name_the_field(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(*argv)


def test_bad_toml_and_unknown_keys(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse("--config", str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("learning_rate = 1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        parse("--config", str(unknown))


def test_join_command_is_the_inverse_of_the_flags():
    options = dict(
        run_id="r1",
        initial_peers=["http://127.0.0.1:1", "http://127.0.0.1:2"],
        task_option=["hidden_dim=8", "input_dim=4"],
        target_batch_size=64,
        lr=0.5,
        mode="params",
        delay_update=False,
        client_mode=True,
        max_epochs=None,
    )
    args = join_command(log_level="INFO", **options)
    assert args[:5] == ["-m", "peer", "--log-level", "INFO", "join"] and args[-1] == "--json"
    parsed = parse(*args[5:-1])
    expected = {name: value for name, value in options.items() if value is not None}
    assert parsed == PeerConfig(**expected)
    with pytest.raises(ConfigError, match="no option 'nope'"):
        join_command(nope=1)


def test_min_deadline_floors_the_averagers_adaptive_waits():
    assert parse().averager_config().min_deadline_s == 1.0
    assert parse("--min-deadline", "3.5").averager_config().min_deadline_s == 3.5


def test_the_digest_schedule_is_on_by_default_and_reaches_the_state_server():
    default = parse().state_sync_config()
    assert (default.max_digest_stride, default.max_digest_gap_s) == (64, 4.0)
    assert parse("--max-digest-stride", "1").state_sync_config().max_digest_stride == 1
    config = parse("--max-digest-stride", "8", "--max-digest-gap", "1").state_sync_config()
    assert (config.max_digest_stride, config.max_digest_gap_s) == (8, 1.0)


def test_the_train_benchs_peers_wait_out_its_longest_pause():
    from peer.bench.train import peer_command
    from peer.bench.train_config import TrainBenchConfig

    config = TrainBenchConfig(seconds=8, window_s=1.5)
    _, window_s = config.windows()
    command = peer_command(config, "http://127.0.0.1:1", 0, metrics_file=Path("m.jsonl"))
    floor_s = float(command[command.index("--min-deadline") + 1])
    assert floor_s > 2 * window_s  # the swarm is paused for up to two baseline windows
    assert "--min-deadline" not in peer_command(config, "http://127.0.0.1:1", 0)  # unpaused


def test_the_train_benchs_delayed_update_reaches_its_peers_in_grad_mode_only():
    from peer.bench.train import peer_command
    from peer.bench.train_config import TrainBenchConfig

    command = peer_command(TrainBenchConfig(delay_update=True), "http://127.0.0.1:1", 0)
    assert parse(*command[command.index("join") + 1 : -1]).delay_update  # (no --json)
    assert "--delay-update" not in peer_command(TrainBenchConfig(), "http://127.0.0.1:1", 0)
    with pytest.raises(ValueError, match="delay_update"):
        TrainBenchConfig(delay_update=True, mode="params")
