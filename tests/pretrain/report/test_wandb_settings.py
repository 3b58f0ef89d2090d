"""W&B's own environment variables against the config's logging.* (which wins only where it
sets a value), and an unreachable server as one line within a bounded time."""

import time

import pytest

from pretrain.config import Config, LoggingConfig, RunConfig, WandbMode
from pretrain.report.wandb_settings import REACH_TIMEOUT_S, check_wandb, wandb_settings
from runtime.errors import ConfigError
from runtime.launcher import free_port

VARIABLES = ("WANDB_MODE", "WANDB_DISABLED", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP",
             "WANDB_NAME", "WANDB_DIR", "WANDB_API_KEY", "WANDB_BASE_URL")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` of this machine
    monkeypatch.setenv("HOME", str(tmp_path))


def _config(run_dir="runs/x", **logging) -> Config:
    return Config(run=RunConfig(dir=run_dir), logging=LoggingConfig(**logging))


def test_the_environment_decides_what_the_config_leaves_unset(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_PROJECT", "theirs")
    monkeypatch.setenv("WANDB_RUN_GROUP", "g1")
    monkeypatch.setenv("WANDB_DIR", "/elsewhere")
    w = wandb_settings(_config())
    assert (w.mode, w.mode_source) == (WandbMode.ONLINE, "WANDB_MODE")
    assert w.project == ("theirs", "WANDB_PROJECT")
    assert w.group == ("g1", "WANDB_RUN_GROUP")
    assert w.name == ("x", "default")  # the run folder's name
    assert w.dir == ("/elsewhere", "WANDB_DIR")
    assert "mode online (WANDB_MODE)" in w.text() and "dir /elsewhere (WANDB_DIR)" in w.text()


def test_a_value_the_config_sets_wins_and_says_so(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_PROJECT", "theirs")
    w = wandb_settings(_config(wandb_mode="offline", project="mine"))
    assert (w.mode, w.mode_source) == (WandbMode.OFFLINE, "logging.wandb_mode")
    assert w.project == ("mine", "logging.project")
    assert "mode offline (logging.wandb_mode)" in w.text()


def test_nothing_set_means_offline_without_credentials_and_the_default_project():
    w = wandb_settings(_config())
    assert w.mode is WandbMode.OFFLINE and w.project == ("siamesenorm", "default")
    assert w.dir == ("runs/x", "run.dir")


def test_wandb_aliases_and_a_bad_mode(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_settings(_config()).mode is WandbMode.OFFLINE
    monkeypatch.setenv("WANDB_MODE", "off")
    with pytest.raises(ConfigError, match=r"WANDB_MODE \('off'\) must be one of online"):
        wandb_settings(_config())
    monkeypatch.setenv("WANDB_DISABLED", "true")
    assert wandb_settings(_config()).mode is WandbMode.DISABLED


def test_an_unreachable_server_is_one_line_in_bounded_time(monkeypatch):
    """A closed loopback port stands for a server that cannot be reached."""
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    began = time.monotonic()
    with pytest.raises(ConfigError) as err:
        check_wandb(_config())
    assert time.monotonic() - began < REACH_TIMEOUT_S + 1
    text = str(err.value)
    assert "\n" not in text
    assert f"W&B server {url} cannot be reached (Connection refused" in text, text
    assert "--logging.wandb_mode=offline" in text


def test_online_without_credentials_names_where_online_came_from(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match=r"W&B mode online \(WANDB_MODE\) needs W&B "
                                          "credentials"):
        check_wandb(_config())


def test_the_sync_advice_names_the_folder_wandb_writes_to(monkeypatch, tmp_path):
    """An online start without credentials advises offline and `wandb sync`: with WANDB_DIR
    set, the offline files are under it, and the advice says so."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    with pytest.raises(ConfigError, match=rf"`wandb sync {tmp_path / 'wb'}/wandb/offline-run-\*`"):
        check_wandb(_config())
    monkeypatch.delenv("WANDB_DIR")
    with pytest.raises(ConfigError, match=r"`wandb sync RUN/wandb/offline-run-\*`"):
        check_wandb(_config())


@pytest.mark.slow  # trains through the CLI
def test_a_run_stays_in_its_w_and_b_project_when_nothing_names_one(data, tmp_path):
    """A run started with WANDB_PROJECT, resumed without it, stays in that project (the run
    folder remembers it) instead of starting its run id again in the default project; a
    project named on resume that is not the run's is used, with a warning."""
    from tests.pretrain_fixtures import cli, train_args
    from tests.wandb_reader import read_project

    run = tmp_path / "run"
    base = ["--logging.wandb_mode=offline", "--logging.project=", "--data.valid_samples=0"]
    cli(*train_args(data, run, "--run.steps=3", *base), extra_env={"WANDB_PROJECT": "mine"})
    resumed = cli(*train_args(data, run, "--run.steps=4", "--optim.override_schedule=true",
                              *base))
    assert "project mine (the run's, wandb_run.json)" in resumed.stderr, resumed.stderr[-2000:]
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [read_project(f) for f in files] == ["mine", "mine"]
    other = cli(*train_args(data, run, "--run.steps=5", "--optim.override_schedule=true",
                            *base), extra_env={"WANDB_PROJECT": "theirs"})
    assert (f"W&B project theirs (WANDB_PROJECT) is not the run's (mine, {run}/wandb_run.json)"
            ": its run id starts there as another run") in other.stderr
