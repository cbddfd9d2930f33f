"The README's Python code runs as copied: each ```python block in a fresh interpreter, offline (issue 34.2)"
import re, os, sys, subprocess
from pathlib import Path
import pytest

README = Path(__file__).resolve().parent.parent/'README.md'
blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)

def test_readme_has_a_complete_example():
    assert blocks and any('to_half(' in b and '.fit' in b for b in blocks)

@pytest.mark.parametrize('i', range(len(blocks)))
def test_readme_block_runs(i, tmp_path):
    "As a user pastes it: a new process, nothing imported before, in an empty folder; it says what `to_half` chose"
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(README.parent), os.environ.get('PYTHONPATH', '')])}
    r = subprocess.run([sys.executable, '-c', blocks[i]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    if 'to_half()' in blocks[i]: assert "to_half('auto') on " in r.stdout, r.stdout[-2000:]  # nothing silent
