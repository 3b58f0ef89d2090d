"""The paper's presets (configs/paper) and the ``base`` inheritance they are written with."""

import importlib.util
from pathlib import Path

import pytest

from model.schemes import ResidualScheme
from pretrain.config import Config, load_config, validate
from runtime.errors import ConfigError
from tests.pretrain_fixtures import REPO

PAPER = REPO / "configs" / "paper"
PRESETS = sorted(p for p in PAPER.rglob("*.toml") if not p.name.startswith("_"))
# The paper's depth sweep, layers x hidden, each ~390M parameters.
DEPTH_SHAPES = ((10, 1280), (17, 1024), (33, 768), (80, 512))


def _tokens(config: Config) -> int:
    return config.data.global_batch_size * config.model.seq_length * config.run.steps


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_base_is_merged_key_by_key_and_overridden(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path, "root.toml", '[optim]\nlr = 1e-3\nmin_lr = 1e-5\n[run]\nsteps = 500\n')
    _write(tmp_path / "sub", "mid.toml", 'base = "../root.toml"\n[optim]\nmin_lr = 2e-5\n')
    child = _write(tmp_path / "sub", "child.toml",
                   'base = "mid.toml"\n[model]\nnum_layers = 4\n[optim]\nlr = 5e-4\n')
    config = load_config(str(child), ["--optim.min_lr=3e-5"])
    assert (config.optim.lr, config.optim.min_lr) == (5e-4, 3e-5)  # child, command line
    assert config.run.steps == 500 and config.model.num_layers == 4  # root, child


def test_missing_base_and_cycles_are_one_line_errors(tmp_path):
    lonely = _write(tmp_path, "lonely.toml", 'base = "nowhere.toml"\n')
    with pytest.raises(ConfigError, match=r"lonely.toml': base '.*nowhere.toml' does not exist"):
        load_config(str(lonely))
    _write(tmp_path, "a.toml", 'base = "b.toml"\n')
    _write(tmp_path, "b.toml", 'base = "a.toml"\n')
    with pytest.raises(ConfigError, match=r"base files form a cycle \(.*a.toml -> .*b.toml"):
        load_config(str(tmp_path / "a.toml"))
    wrong = _write(tmp_path, "wrong.toml", "base = 3\n")
    with pytest.raises(ConfigError, match=r"base \(3\) must be a file name"):
        load_config(str(wrong))


def test_every_scheme_has_every_paper_run():
    """A run of the paper, for any residual scheme, is launched by a file name alone."""
    for scheme in ResidualScheme:
        for lr in ("4e-4", "1e-3", "2e-3"):
            config = load_config(str(PAPER / "1.3b" / f"{scheme}-lr{lr}.toml"))
            m = config.model
            assert (m.residual_scheme, config.optim.lr) == (scheme, float(lr))
            assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups,
                    m.ffn_hidden_size, m.seq_length) == (16, 2048, 32, 8, 8192, 4096)
            assert 100e9 <= _tokens(config) < 100.01e9
        long_run = load_config(str(PAPER / "1.3b" / f"{scheme}-lr2e-3-350b.toml"))
        assert long_run.optim.lr == 2e-3 and 350e9 <= _tokens(long_run) < 350.01e9
        for layers, hidden in DEPTH_SHAPES:
            config = load_config(str(PAPER / "depth" / f"{scheme}-{layers}x{hidden}.toml"))
            m = config.model
            assert (m.residual_scheme, m.num_layers, m.hidden_size) == (scheme, layers, hidden)
            assert config.optim.lr == 1e-3 and 12e9 <= _tokens(config) < 12.01e9
        moe = load_config(str(PAPER / "moe" / f"{scheme}-lr1e-3.toml"))
        m = moe.model
        assert (m.residual_scheme, moe.optim.lr) == (scheme, 1e-3)
        assert (m.num_experts, m.moe_router_topk, m.moe_layer_freq) == (96, 8, 1)
        assert 100e9 <= _tokens(moe) < 100.01e9
    both_off = "siamese-no-input-norm-no-depth-constant-lr1e-3.toml"
    ablation = load_config(str(PAPER / "1.3b" / both_off))
    assert not ablation.model.siamese_input_norm and not ablation.model.siamese_depth_constant


def test_paper_presets_share_the_recipe_and_never_share_a_run_folder():
    configs = {p: load_config(str(p)) for p in PRESETS}
    for path, config in configs.items():
        if path.parent.name == "long":  # a context extension: its own recipe, longer
            assert config.run.init_from and config.model.rotary_base > 10000, path
            assert config.seq_length > 4096 and config.parallel.cp > 1, path
        else:
            assert config.optim.warmup_steps == 2000, path
            assert config.model.seq_length == 4096, path
        # The default layout is the recommended one for 8, 32 and 64 GPUs alike (see the bases).
        assert (config.parallel.tp, config.parallel.pp) == (1, 1), path
        for world in (8, 32, 64):
            validate(config, world_size=world)
    # A shared run folder would make one run resume from another's checkpoints.
    assert len({c.run.dir for c in configs.values()}) == len(configs)
    assert len({c.logging.name for c in configs.values()}) == len(configs)


def test_presets_are_what_generate_py_writes(capsys):
    """The generated presets are committed; a changed table of runs (or a new residual scheme)
    must be followed by running the script again."""
    spec = importlib.util.spec_from_file_location("generate", PAPER / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.main(["--check"]) == 0, capsys.readouterr().out
    assert sorted(generate.presets()) == sorted(str(p.relative_to(PAPER)) for p in PRESETS)
    assert generate.main(["--bogus"]) == 2


def test_defaults_alone_are_a_valid_config():
    """Every preset builds on the dataclass defaults, so they must pass the checks themselves."""
    validate(load_config(None, []), world_size=1)
