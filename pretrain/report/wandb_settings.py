"""W&B set the way its users set it: its own environment variables count, and the config's
``logging.*`` wins only where the config sets a value.

Field by field (the start prints what it chose and from where):

    mode     logging.wandb_mode unless it is auto; else WANDB_MODE (or WANDB_DISABLED=true);
             else auto's rule: online with credentials (WANDB_API_KEY or `wandb login`)
    project  logging.project; else WANDB_PROJECT; else "siamesenorm"
    entity   logging.entity; else WANDB_ENTITY; else the account's default entity
    group    logging.group; else WANDB_RUN_GROUP
    name     logging.name; else WANDB_NAME; else the run folder's name
    dir      WANDB_DIR; else run.dir (no config field)

An online run first asks the W&B server (WANDB_BASE_URL, else api.wandb.ai) for any answer
within :data:`REACH_TIMEOUT_S`: an unreachable server is then one error line before anything
is written, not wandb's own minutes of retries and tracebacks after the run folder was.
"""

from __future__ import annotations

import netrc
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlparse

from pretrain.config import Config, WandbMode
from runtime.errors import ConfigError

DEFAULT_PROJECT = "siamesenorm"
DEFAULT_BASE_URL = "https://api.wandb.ai"
REACH_TIMEOUT_S = 10.0
"""How long an online start waits for the W&B server's first answer."""
MODES = {"online": WandbMode.ONLINE, "run": WandbMode.ONLINE, "offline": WandbMode.OFFLINE,
         "dryrun": WandbMode.OFFLINE, "disabled": WandbMode.DISABLED}
"""WANDB_MODE's values (wandb's own aliases included)."""


class Setting(NamedTuple):
    value: str
    source: str
    """Where it came from: ``logging.<field>``, an environment variable, or ``default``."""


class WandbSettings(NamedTuple):
    mode: WandbMode
    mode_source: str
    project: Setting
    entity: Setting
    group: Setting
    name: Setting
    dir: Setting

    def text(self) -> str:
        """The start's line: every value and where it came from."""
        shown = [f"mode {self.mode.value} ({self.mode_source})"]
        for field in ("project", "entity", "group", "name", "dir"):
            setting = getattr(self, field)
            if setting.value:
                shown.append(f"{field} {setting.value} ({setting.source})")
        return "W&B: " + ", ".join(shown)


def base_url() -> str:
    return os.environ.get("WANDB_BASE_URL", "").rstrip("/") or DEFAULT_BASE_URL


def has_credentials() -> bool:
    """WANDB_API_KEY or a netrc entry for the server's host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(netrc.netrc().authenticators(urlparse(base_url()).hostname or ""))
    except (OSError, netrc.NetrcParseError):
        return False


def _mode(config: Config) -> tuple[WandbMode, str]:
    given = config.logging.wandb_mode
    if given is not WandbMode.AUTO:
        return given, "logging.wandb_mode"
    if os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1", "yes"):
        return WandbMode.DISABLED, "WANDB_DISABLED"
    env = os.environ.get("WANDB_MODE", "")
    if env:
        if env not in MODES:
            raise ConfigError(f"WANDB_MODE ('{env}') must be one of {', '.join(MODES)}")
        return MODES[env], "WANDB_MODE"
    if has_credentials():
        return WandbMode.ONLINE, "auto: W&B credentials found"
    return WandbMode.OFFLINE, "auto: no W&B credentials"


def _pick(config_value: str, field: str, variable: str, default: str = "") -> Setting:
    if config_value:
        return Setting(config_value, f"logging.{field}")
    if os.environ.get(variable):
        return Setting(os.environ[variable], variable)
    return Setting(default, "default")


def wandb_settings(config: Config) -> WandbSettings:
    lg = config.logging
    mode, source = _mode(config)
    run_dir = Path(config.run.dir)
    return WandbSettings(
        mode, source,
        _pick(lg.project, "project", "WANDB_PROJECT", DEFAULT_PROJECT),
        _pick(lg.entity, "entity", "WANDB_ENTITY"),
        _pick(lg.group, "group", "WANDB_RUN_GROUP"),
        _pick(lg.name, "name", "WANDB_NAME", run_dir.name),
        Setting(os.environ["WANDB_DIR"], "WANDB_DIR") if os.environ.get("WANDB_DIR")
        else Setting(str(run_dir), "run.dir"))


RUN_FILE = "wandb_run.json"
"""In the run folder: the W&B run's id, project and entity, written when W&B first holds it."""


def with_the_runs_project(settings: WandbSettings, run_dir: Path) -> tuple[WandbSettings,
                                                                           str | None]:
    """A run already on W&B is continued in its own project and entity (a resume, or lm-eval
    logging into the run) where nothing names one now: a start without the WANDB_PROJECT the
    run began with would otherwise log the same run id into the default project, as another
    run. A project named now (logging.project, WANDB_PROJECT) that is not the run's is used,
    with the warning returned."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        return settings, None
    import json

    held = json.loads(path.read_text())
    warning = None
    for field in ("project", "entity"):
        setting, theirs = getattr(settings, field), held.get(field) or ""
        if not theirs or setting.value == theirs:
            continue
        if setting.source == "default":
            settings = settings._replace(**{field: Setting(theirs, f"the run's, {RUN_FILE}")})
        elif warning is None:
            warning = (f"W&B {field} {setting.value} ({setting.source}) is not the run's "
                       f"({theirs}, {path}): its run id starts there as another run")
    return settings, warning


def sync_command(settings: WandbSettings) -> str:
    """How to upload an offline run: its files are under the W&B dir (WANDB_DIR, else the run
    folder)."""
    folder = settings.dir.value if settings.dir.source == "WANDB_DIR" else "RUN"
    return f"wandb sync {folder}/wandb/offline-run-*"


def check_wandb(config: Config) -> WandbSettings:
    """What a start checks of W&B before anything is written: WANDB_MODE's value, credentials
    for an online run, and that its server answers (within :data:`REACH_TIMEOUT_S`)."""
    settings = wandb_settings(config)
    if settings.mode is not WandbMode.ONLINE:
        return settings
    if not has_credentials():
        raise ConfigError(f"W&B mode online ({settings.mode_source}) needs W&B credentials: "
                          "set WANDB_API_KEY or run `wandb login`, or use offline (then "
                          f"`{sync_command(settings)}`)")
    reason = unreachable(base_url())
    if reason:
        raise ConfigError(f"W&B server {base_url()} cannot be reached ({reason}; waited at most "
                          f"{REACH_TIMEOUT_S:g} s): check the network or WANDB_BASE_URL, or "
                          "train offline (--logging.wandb_mode=offline, later `wandb sync`)")
    return settings


def unreachable(url: str) -> str | None:
    """Why ``url`` gave no HTTP answer within the timeout (None: it answered, any status)."""
    try:
        with urllib.request.urlopen(url, timeout=REACH_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None  # an answer: the server is there
    except urllib.error.URLError as err:
        return str(getattr(err.reason, "strerror", None) or err.reason)
    except OSError as err:  # a timeout while reading
        return str(err.strerror or err) if not isinstance(err, TimeoutError) else "timed out"
