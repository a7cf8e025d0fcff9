import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

import posbench
from posbench.core.errors import ConfigError

from helpers import run_in_process


def test_compose_defaults():
    cfg = posbench.compose([])
    assert cfg.encoding.name == "rope" and cfg.model.n_layer == 4 and cfg.dataset.name == "pystdlib"
    assert max(cfg.eval.lengths) > cfg.train.seq_len


@pytest.mark.parametrize("preset,vocab,low,high", [("tiny", 256, 0.7e6, 1.3e6),
                                                   ("small", 256, 9e6, 12e6),
                                                   ("gpt2-small", 50257, 120e6, 128e6)])
def test_model_presets_have_their_size(preset, vocab, low, high):
    cfg = posbench.compose([f"model={preset}", "encoding=nope"])
    params = posbench.build_model(cfg, vocab_size=vocab).num_params()
    assert low < params < high


def test_unknown_key_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="trian|not in struct|Could not"):
        posbench.compose(["train.stesp=3"])


def test_wrong_type_fails_at_compose():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        posbench.compose(["train.steps=many"])


def test_unknown_encoding_option_key_fails():
    with pytest.raises(ConfigCompositionException):
        posbench.compose(["encoding=alibi", "encoding.base=3"])


@pytest.mark.parametrize("override,key", [
    ("eval.lengths=[]", "eval.lengths"),
    ("eval.lengths=[0,128]", "eval.lengths"),
    ("eval.lengths=[-5]", "eval.lengths"),
    ("train.seq_len=0", "train.seq_len"),
    ("model.n_head=3", "model.d_model"),
    ("eval.protocol=sideways", "eval.protocol"),
    ("device=tpu", "device"),
    ("dataset.tokenizer=oops", "dataset.tokenizer"),
    ("encoding.base=-1", "encoding.base"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        posbench.compose([override])


def test_non_integer_length_fails():
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError)):
        posbench.compose(["eval.lengths=[1.5]"])


@pytest.mark.parametrize("override,suggestion", [("encoding=alibj", "'alibi'"),
                                                 ("model=tinny", "'tiny'"),
                                                 ("train.stpes=3", "'steps'")])
def test_a_misspelt_value_or_key_is_refused_with_the_closest_option(override, suggestion,
                                                                   monkeypatch, capsys):
    proc = run_in_process(["train", override], monkeypatch, capsys)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert f"(did you mean {suggestion}?)" in proc.stderr


def test_hydras_copies_of_its_config_repository_share_the_one_config_store():
    """posbench.config lets Hydra's copies of its config repository (one per composition, one per
    group that --help lists) share the ConfigStore rather than copy it: a copy made before a node
    is stored finds that node, as a copy reading the live store would."""
    from hydra._internal.config_repository import CachingConfigRepository, ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_store import ConfigStore

    search_path = create_config_search_path("pkg://posbench.conf")
    copy = CachingConfigRepository(ConfigRepository(search_path))
    store = ConfigStore.instance()
    store.store(group="encoding", name="stored_after_the_copy", node={"name": "rope"})
    try:
        assert copy.load_config("encoding/stored_after_the_copy").config.name == "rope"
    finally:
        del store.repo["encoding"]["stored_after_the_copy.yaml"]
