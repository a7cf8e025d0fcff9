"""Hydra's tab completion works through the `posbench` dispatcher."""
import os
import shutil
import subprocess


def complete(line):
    env = {**os.environ, "COMP_LINE": line, "COMP_POINT": str(len(line))}
    proc = subprocess.run([shutil.which("posbench"), "-sc", "query=bash"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_completes_encoding_names_after_the_train_verb():
    assert {"encoding=alibi", "encoding=alibi_as_group"} <= set(complete("posbench train encoding=al"))


def test_install_script_registers_the_posbench_command():
    proc = subprocess.run([shutil.which("posbench"), "train", "-sc", "install=bash"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.rstrip().endswith("-F hydra_bash_completion posbench")
