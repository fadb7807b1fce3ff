"""The README's own-corpus recipe, run as a new user would from a fresh checkout: its commands
read from the README itself, on a folder of real source (the standard library's ``email``
package, with its ``__pycache__``) plus a binary file; prepare, train, then generate past the
model's context. Only the budget is cut (steps, batch, evaluation)."""

import email
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from extras import need
from helpers import ROOT, SUBPROCESS_ENV

need("tokenizers", "data")

SHORTER = {"--steps 2000": "--steps 20 --seq-len 64 --batch-size 4 --eval-windows 2 --eval-batch-size 2 --no-progress"}
"""The recipe's budget, cut for the test (nothing else of its commands changes)."""


def recipe() -> list[list[str]]:
    """The commands of the README's ```bash block that runs ``python -m moe.data prepare``
    (line continuations joined, comments and ``pip install`` dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    block = next(b for b in blocks if "python -m moe.data prepare" in b)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("pip "):
            for old, new in SHORTER.items():
                line = line.replace(old, new)
            commands.append(shlex.split(line))
    return commands


def test_the_readme_own_corpus_recipe_runs_end_to_end(tmp_path):
    commands = recipe()
    assert [c[:3] for c in commands] == [
        ["python", "-m", "moe.data"],
        ["python", "experiments/train.py", "--data"],
        ["python", "experiments/generate.py", "runs/mine/model.pt"],
    ], commands
    texts = tmp_path / "path" / "to" / "texts"  # the recipe's own input path
    shutil.copytree(Path(email.__file__).parent, texts / "email")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(texts)], check=True)
    (texts / "email" / "notes.bin").write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")  # a checkout: nothing else is there
    outputs = []
    for command in commands:
        proc = subprocess.run(
            [sys.executable, *command[1:]],
            cwd=tmp_path,
            env=SUBPROCESS_ENV,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        outputs.append(proc.stdout)
    prepared, trained, sampled = outputs
    assert (
        "skipped 1 file that is empty (email/mime/__init__.py); 1 file that is not text (email/notes.bin); "
        "2 cache folders (__pycache__)"
    ) in prepared, prepared
    assert "data: data/mine (" in trained and (tmp_path / "runs" / "mine" / "model.pt").is_file(), trained
    # 32 prompt tokens + 200 new ones ran past the tiny preset's 128 positions (each a byte or more)
    assert len(sampled.encode()) >= 232, sampled
