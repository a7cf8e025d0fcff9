"""A user's own encoding, outside the package, plugs in through Hydra's `_target_`."""
import json
import os
import shutil
import subprocess
import textwrap

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
    args = [shutil.which("posbench"), "train", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            "encoding=power", *toy, "hydra.run.dir=run"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "results.json").read_text())
    assert record["encoding"] == "power" and record["config"]["encoding"]["alpha"] == 0.7
    bad = subprocess.run(args[:-1] + ["encoding.alpha=oops", "hydra.run.dir=run2"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "alpha" in bad.stderr and "Traceback" not in bad.stderr
