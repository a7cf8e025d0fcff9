"""A user's own encoding, outside the package, plugs in through Hydra's `_target_`."""
import os
import textwrap

from helpers import posbench_cli, results

ENCODING = '''
from dataclasses import dataclass

from posbench.encodings import EncodingConfig, PositionalEncoding


class PowerBias(PositionalEncoding):
    """score - lag ** alpha"""
    family = "bias"
    relative = True
    past_train_len = "defined at every lag"
    reference = "posbench test"

    @dataclass
    class Config(EncodingConfig):
        alpha: float = 0.5

    def score_mod(self, q, k, pos, layer):
        alpha = self.cfg.alpha

        def power(score, b, h, q_idx, kv_idx):
            return score - (pos[b, q_idx] - pos[b, kv_idx]).float().pow(alpha)

        return power
'''


def test_outside_encoding_through_target_and_searchpath(tmp_path, toy):
    (tmp_path / "my_pe.py").write_text(textwrap.dedent(ENCODING))
    (tmp_path / "conf" / "encoding").mkdir(parents=True)
    (tmp_path / "conf" / "encoding" / "power.yaml").write_text(
        "_target_: my_pe.PowerBias\nname: power\nalpha: 0.7\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    args = ["train", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "encoding=power", *toy]
    posbench_cli(*args, "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=300)
    record = results(tmp_path / "run")
    assert record["encoding"] == "power" and record["config"]["encoding"]["alpha"] == 0.7
    bad = posbench_cli(*args, "encoding.alpha=oops", "hydra.run.dir=run2", cwd=tmp_path, env=env,
                       timeout=300, ok=False)
    assert bad.returncode != 0 and "alpha" in bad.stderr and "Traceback" not in bad.stderr
